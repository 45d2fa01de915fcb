//! A model directory's safetensors files, memory-mapped: `model.safetensors`, or else the shards
//! `model.safetensors.index.json`'s `weight_map` names. Every tensor is checked against the shape
//! the config implies before it is used, and converted to the compute dtype on load (a bf16
//! checkpoint computes in f32 on the CPU).
//!
//! The one `unsafe` here is the memory map (candle's `MmapedSafetensors`): a mapped file that
//! another process truncates or rewrites while it is mapped is undefined behaviour, so the
//! weights must not change while a run reads them (a model directory is an input, never
//! written by hspipe).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::{ModelError, Result};

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// The mapped weights of one model directory.
pub struct Weights {
    dir: PathBuf,
    files: Vec<(PathBuf, MmapedSafetensors)>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
    device: Device,
    dtype: DType,
    /// Made up instead of read (`Weights::random`): the speed benchmarks' large shapes.
    random: bool,
}

impl Weights {
    /// Maps the weights of `dir`, to be loaded onto `device` as `dtype`.
    pub fn open(dir: &Path, device: &Device, dtype: DType) -> Result<Weights> {
        let index_path = dir.join(INDEX);
        let single = dir.join(SINGLE);
        // transformers' order: `model.safetensors` where there is one, whatever index is beside it.
        let (paths, named): (Vec<PathBuf>, Option<BTreeMap<String, String>>) = if single.exists() {
            (vec![single], None)
        } else if index_path.exists() {
            let text = atomic_file::read_regular(&index_path).map_err(|source| ModelError::Io {
                path: index_path.clone(),
                cause: source,
            })?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let idx: Index = serde_json::from_str(&text).map_err(|e| ModelError::Weights {
                file: index_path.clone(),
                why: format!("not a safetensors index: {e}"),
            })?;
            let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            if let Some(f) = files
                .iter()
                .find(|f| Path::new(f).components().count() != 1)
            {
                return Err(ModelError::Weights {
                    file: index_path,
                    why: format!("shard {f:?} is not a file name in the model directory"),
                });
            }
            (
                files.iter().map(|f| dir.join(f)).collect(),
                Some(idx.weight_map),
            )
        } else if !dir.is_dir() {
            return Err(ModelError::Io {
                path: dir.to_path_buf(),
                cause: std::io::Error::new(std::io::ErrorKind::NotFound, "no such model directory"),
            });
        } else {
            return Err(ModelError::Weights {
                file: dir.to_path_buf(),
                why: format!("no {SINGLE} and no {INDEX}: not an HF model directory with safetensors weights"),
            });
        };
        let mut files = Vec::with_capacity(paths.len());
        for p in paths {
            if !p.exists() {
                return Err(ModelError::Weights {
                    file: dir.join(INDEX),
                    why: format!("names shard {}, which does not exist", p.display()),
                });
            }
            // A FIFO's open (by the map below) waits for a writer, for ever if none comes.
            let meta = std::fs::metadata(&p).map_err(|source| ModelError::Io {
                path: p.clone(),
                cause: source,
            })?;
            if let Some(what) = atomic_file::not_regular(&meta) {
                return Err(ModelError::Weights {
                    file: p.clone(),
                    why: format!("it is {what}, not a regular file"),
                });
            }
            // SAFETY: the map is read-only and the model directory is an input nobody writes
            // while hspipe runs (module doc); candle checks the header against the file's size.
            let st = unsafe { MmapedSafetensors::new(&p) }.map_err(|e| ModelError::Weights {
                file: p.clone(),
                why: format!("not a safetensors file: {e}"),
            })?;
            files.push((p, st));
        }
        let mut index = HashMap::new();
        for (i, (_, st)) in files.iter().enumerate() {
            for (name, _) in st.tensors() {
                index.insert(name, i);
            }
        }
        if let Some(named) = named {
            for (tensor, file) in named {
                let want = dir.join(&file);
                match index.get(&tensor) {
                    Some(&i) if files[i].0 == want => {}
                    _ => {
                        return Err(ModelError::Missing {
                            dir: want,
                            tensor,
                            hint: format!(" ({INDEX} says it is there)"),
                        })
                    }
                }
            }
        }
        Ok(Weights {
            dir: dir.to_path_buf(),
            files,
            index,
            device: device.clone(),
            dtype,
            random: false,
        })
    }

    /// Weights of any shape asked for, made on `device` (nothing read): normal with standard
    /// deviation 0.02 (HF's initializer range), ones for the norms. For measuring speed at a
    /// real model's size without a checkpoint (a Qwen3-8B shape on a GPU machine that cannot
    /// download one); seed the device (`Device::set_seed`) for repeatable values.
    pub fn random(device: &Device, dtype: DType) -> Weights {
        Weights {
            dir: PathBuf::from("<random>"),
            files: Vec::new(),
            index: HashMap::new(),
            device: device.clone(),
            dtype,
            random: true,
        }
    }

    /// The safetensors files the weights are read from, in order (one, or an index's shards).
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// Whether the files hold tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.random || self.index.contains_key(name)
    }

    /// Tensor `name`, which must have shape `shape`, in the compute dtype on the device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if self.random {
            let made = if name.ends_with("norm.weight") {
                Tensor::ones(shape, self.dtype, &self.device)
            } else {
                Tensor::randn(0f32, 0.02, shape, &self.device).and_then(|t| t.to_dtype(self.dtype))
            };
            return made.map_err(|e| ModelError::Weights {
                file: self.dir.clone(),
                why: format!("making tensor {name} {shape:?}: {e}"),
            });
        }
        let (file, st) = self.checked(name, shape)?;
        let t = st
            .load(name, &self.device)
            .and_then(|t| t.to_dtype(self.dtype))
            .map_err(|e| ModelError::Weights {
                file: file.clone(),
                why: format!("tensor {name}: {e}"),
            })?;
        Ok(t)
    }

    /// What [`Weights::get`] checks before it loads tensor `name` (there, of shape `shape`, in
    /// a dtype that is read), from the file's header alone: nothing is read or converted.
    pub fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        if self.random {
            return Ok(());
        }
        self.checked(name, shape).map(|_| ())
    }

    /// The file holding tensor `name`, once its header says the shape is `shape` and the
    /// dtype one that is read.
    fn checked(&self, name: &str, shape: &[usize]) -> Result<&(PathBuf, MmapedSafetensors)> {
        let Some(&i) = self.index.get(name) else {
            return Err(ModelError::Missing {
                dir: self.dir.clone(),
                tensor: name.to_string(),
                hint: String::new(),
            });
        };
        let found = &self.files[i];
        let (file, st) = found;
        let view = st.get(name).map_err(|e| ModelError::Weights {
            file: file.clone(),
            why: format!("tensor {name}: {e}"),
        })?;
        if view.shape() != shape {
            return Err(ModelError::Shape {
                file: file.clone(),
                tensor: name.to_string(),
                want: shape.to_vec(),
                got: view.shape().to_vec(),
            });
        }
        use safetensors::Dtype as S;
        if !matches!(view.dtype(), S::F32 | S::F16 | S::BF16) {
            return Err(ModelError::Weights {
                file: file.clone(),
                why: format!(
                    "tensor {name} is stored as {:?}: only f32, f16 and bf16 weights are read (no quantized checkpoints)",
                    view.dtype()
                ),
            });
        }
        Ok(found)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A weights file, or a shard an index names, that is a FIFO is refused before it is
    /// opened: the map's open waited for a writer for ever (`launcher capture` hung).
    #[test]
    fn a_weights_file_or_shard_that_is_a_fifo_is_refused_without_opening_it() {
        let e = testkit::fifo_refusal(SINGLE, |d| {
            Weights::open(d, &Device::Cpu, DType::F32)
                .err()
                .map(|e| e.to_string())
        });
        assert!(e.contains(SINGLE) && e.contains("FIFO"), "{e}");
        let shard = "model-00001-of-00001.safetensors";
        let e = testkit::fifo_refusal(shard, move |d| {
            let index = format!(r#"{{"weight_map": {{"lm_head.weight": "{shard}"}}}}"#);
            std::fs::write(d.join(INDEX), index).unwrap();
            Weights::open(d, &Device::Cpu, DType::F32)
                .err()
                .map(|e| e.to_string())
        });
        assert!(e.contains(shard) && e.contains("FIFO"), "{e}");
    }
}
