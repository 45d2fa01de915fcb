//! The crate's tests: the format read back, every row error, the cache's reuse and
//! invalidation, and damaged files refused without a panic.
//!
//! Length: one test per behaviour of the cache and the mapped file, each standing alone, with
//! the fixtures they share.

use std::path::{Path, PathBuf};

use crate::{prepare, DataError, Kind, Mapped, Writer};

mod inputs;

/// A directory removed at the end of the test (kept when it fails, to look at).
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("hspipe-dataset-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
    fn file(&self, name: &str, text: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

type Owned = (Vec<u32>, Option<Vec<u8>>);

fn samples(n: usize) -> Vec<Owned> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7919) % 300;
            let ids = (0..len)
                .map(|j| ((i * 31 + j * 17) % 100_000) as u32 + u32::from(i == 3) * 4_000_000_000)
                .collect();
            let mask = (i % 3 != 0).then(|| (0..len).map(|j| u8::from(j >= len / 4)).collect());
            (ids, mask)
        })
        .collect()
}

fn read_all(m: &Mapped) -> Vec<Owned> {
    (0..m.len())
        .map(|i| {
            let s = m.sample(i).unwrap();
            (s.input_ids.to_vec(), s.loss_mask.map(|m| m.into_owned()))
        })
        .collect()
}

fn write(path: &Path, data: &[Owned], batch_tokens: usize) {
    let f = std::fs::File::create(path).unwrap();
    let mut w = Writer::new(f, vec![("hspipe.dataset".into(), "1".into())])
        .unwrap()
        .batch_tokens(batch_tokens);
    for (ids, mask) in data {
        w.push(ids, mask.as_deref()).unwrap();
    }
    w.finish(Vec::new()).unwrap();
}

/// Where the stream of an Arrow file starts: after the 6-byte magic, padded with zeros to the
/// writer's alignment (8 in the format's words, 64 as arrow-rs writes it).
fn stream_start(file: &[u8]) -> usize {
    (8..file.len())
        .step_by(8)
        .find(|&i| file[i..i + 4] != [0; 4])
        .unwrap()
}

fn jsonl_of(data: &[Owned]) -> String {
    data.iter()
        .map(|(ids, mask)| match mask {
            Some(m) => format!("{{\"input_ids\": {ids:?}, \"loss_mask\": {m:?}}}\n"),
            None => format!("{{\"input_ids\": {ids:?}}}\n"),
        })
        .collect()
}

#[test]
fn what_is_written_maps_back_sample_for_sample_across_many_record_batches() {
    let d = Dir::new("rt");
    let data = samples(500);
    for batch_tokens in [1, 1000, 1 << 22] {
        let p = d.0.join(format!("x{batch_tokens}.arrow"));
        write(&p, &data, batch_tokens);
        let m = Mapped::open(&p).unwrap();
        assert_eq!(m.len(), 500);
        assert_eq!(read_all(&m), data, "batch_tokens {batch_tokens}");
        // Letting go of the resident pages changes nothing that is read afterwards.
        m.unmap_resident();
        assert_eq!(read_all(&m), data, "after unmap_resident");
        let lens: Vec<u32> = data.iter().map(|(i, _)| i.len() as u32).collect();
        assert_eq!(m.lengths(), lens);
        assert_eq!(m.tokens(), lens.iter().map(|&l| u64::from(l)).sum::<u64>());
        assert!(m.sample(500).is_none());
        // The file is also an Arrow stream after its magic and padding, as the format says.
        let bytes = std::fs::read(&p).unwrap();
        let s =
            arrow_ipc::reader::StreamReader::try_new(&bytes[stream_start(&bytes)..], None).unwrap();
        let rows: usize = s.map(|b| b.unwrap().num_rows()).sum();
        assert_eq!(rows, 500);
        // Zero-copy: every sample's ids are bytes of the map.
        let map = m.map_range();
        for i in 0..m.len() {
            let ids = m.sample(i).unwrap().input_ids.as_ptr_range();
            assert!(map.contains(&(ids.start as usize)) && ids.end as usize <= map.end);
        }
    }
}

#[test]
fn every_cut_of_a_prepared_file_and_garbage_are_errors_not_panics() {
    let d = Dir::new("cut");
    let p = d.0.join("x.arrow");
    write(&p, &samples(40), 500);
    let bytes = std::fs::read(&p).unwrap();
    // Every cut near the ends (header, schema, footer), and a spread of cuts in between.
    let n = bytes.len();
    let cuts = (0..n).filter(|&c| c < 1024 || c + 1024 > n || c % 61 == 0);
    for cut in cuts {
        let q = d.file("cut.arrow", &bytes[..cut]);
        assert!(Mapped::open(&q).is_err(), "cut at {cut} of {}", bytes.len());
    }
    // Flipped bytes: refused or read, never a panic.
    for i in (0..bytes.len()).step_by(13) {
        let mut b = bytes.clone();
        b[i] ^= 0x5a;
        let q = d.file("flip.arrow", &b);
        if let Ok(m) = Mapped::open(&q) {
            let _ = read_all(&m);
        }
    }
}

fn jsonl(text: &str, max_len: u32) -> Result<Vec<Owned>, DataError> {
    let d = Dir::new("jsonl");
    let input = d.file("train.jsonl", text.as_bytes());
    let p = prepare(&input, max_len, &d.0.join("cache"), None, &mut crate::quiet)?;
    Ok(read_all(&Mapped::open(&p.path).unwrap()))
}

/// A file of a format hspipe does not read (a CSV) is read as JSONL, the fallback for what is
/// no Arrow or Parquet file, and said only "data.csv:1: not a sample: expected value": now the
/// error says it was read as JSONL because of its extension, and names the formats read. A
/// file named as JSONL gets its line's error alone.
#[test]
fn a_file_of_an_unknown_extension_says_it_was_read_as_jsonl() {
    let d = Dir::new("csv");
    let input = d.file("data.csv", b"input_ids,loss_mask\n1,1\n");
    let err = prepare(&input, 8, &d.0.join("cache"), None, &mut crate::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("data.csv:1: not a sample")
            && err.contains("read as JSONL, since .csv is not an extension hspipe knows")
            && err.contains("Parquet"),
        "{err}"
    );
    let err = jsonl("input_ids,loss_mask\n", 8).unwrap_err().to_string();
    assert!(
        err.contains("train.jsonl:1: not a sample") && !err.contains("read as JSONL"),
        "{err}"
    );
}

/// A line past 64 MiB is refused naming it, not held whole: a 300 MB one (an export in one
/// object) took 600 MB to be refused as not a sample, and aborted under a memory limit. The
/// error says it is a limit of JSONL lines, not of the record (which `data.too_long` would
/// drop), and where such a record can go: it said no sample is near this long, while the
/// README called records of hundreds of MB cheap.
#[test]
fn a_jsonl_line_past_the_limit_is_refused_naming_it() {
    let long = format!(
        "{{\"input_ids\": [1]}}\n{{\"input_ids\": [{}1]}}\n",
        "1,".repeat((64 << 20) / 2)
    );
    let err = jsonl(&long, 8).unwrap_err().to_string();
    assert!(
        err.contains(
            "train.jsonl:2: the line is longer than 64 MiB, the most hspipe reads of one JSONL line"
        ) && err.contains("before data.too_long could drop or cut its record")
            && err.contains("in Parquet or Arrow instead"),
        "{err}"
    );
}

#[test]
fn jsonl_reads_samples_and_names_the_bad_line() {
    let got = jsonl(
        "{\"input_ids\": [1,2,3]}\n\n{\"input_ids\": [4], \"loss_mask\": [0]}\n",
        8,
    )
    .unwrap();
    assert_eq!(got, vec![(vec![1, 2, 3], None), (vec![4], Some(vec![0]))]);

    let cases = [
        (
            "{\"input_ids\": [1]}\n{\"input_ids\": [1,\n",
            ":2: not a sample",
        ),
        ("{\"input_ids\": []}\n", ":1: input_ids is empty"),
        (
            "{\"input_ids\": [1,2], \"loss_mask\": [1]}\n",
            ":1: loss_mask has 1 entries",
        ),
        (
            "{\"input_ids\": [1,2], \"loss_mask\": [1, 2]}\n",
            ":1: loss_mask entries must be 0 or 1",
        ),
        (
            "{\"input_ids\": [1,2,3,4,5,6,7,8,9]}\n",
            ":1: 9 tokens, more than data.max_len 8",
        ),
        (
            "\n{\"input_ids\": [1.5]}\n",
            ":2: not a sample: invalid type: floating point",
        ),
        (
            "{\"input_ids\": [-1]}\n",
            ":1: not a sample: invalid value: integer `-1`",
        ),
        (
            "{\"input_ids\": [4294967296]}\n",
            ":1: not a sample: invalid value: integer `4294967296`",
        ),
        ("{\"ids\": [1]}\n", ":1: not a sample"),
        ("\n\n", "has no samples"),
    ];
    for (text, want) in cases {
        let err = jsonl(text, 8).unwrap_err().to_string();
        assert!(
            err.contains(want) && err.contains("train.jsonl"),
            "{err:?} should contain {want:?}"
        );
    }
    let err = prepare(
        Path::new("/nonexistent/x.jsonl"),
        8,
        Path::new("/nonexistent/cache"),
        None,
        &mut crate::quiet,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("/nonexistent/x.jsonl"), "{err}");
}

#[test]
fn a_failed_conversion_leaves_nothing_in_the_cache() {
    let d = Dir::new("fail");
    let input = d.file("bad.jsonl", b"{\"input_ids\": [1]}\n{\"input_ids\": []}\n");
    let cache = d.0.join("cache");
    assert!(prepare(&input, 8, &cache, None, &mut crate::quiet).is_err());
    assert!(!cache.exists(), "the cache directory it made is gone again");
}

/// A stop asked for through the progress callback (the launcher's Ctrl-C) ends the work at
/// its next report, hashing or converting, and leaves nothing in the cache: no temporary file
/// (before, the signal killed the process and left one as big as the prepared file).
#[test]
fn a_preparation_stopped_by_its_caller_leaves_nothing_behind() {
    let d = Dir::new("cancel");
    // More than 4096 lines: the conversion reports (and hears a stop) before its end.
    let input = d.file("data.jsonl", jsonl_of(&samples(5000)).as_bytes());
    let cache = d.0.join("cache");
    std::fs::create_dir(&cache).unwrap();
    for stop_at in [crate::Stage::Hashing, crate::Stage::Converting] {
        let mut seen = Vec::new();
        let err = prepare(&input, 512, &cache, None, &mut |p| {
            seen.push((p.stage, p.done));
            if p.stage == stop_at {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })
        .unwrap_err();
        assert!(matches!(err, DataError::Cancelled { .. }), "{err}");
        assert!(err.to_string().contains("data.jsonl"), "{err}");
        let last = *seen.last().unwrap();
        assert_eq!(
            last.0, stop_at,
            "it stopped at the first report of {stop_at:?}"
        );
        let total = std::fs::metadata(&input).unwrap().len();
        if stop_at == crate::Stage::Converting {
            assert!(last.1 < total, "stopped before the end: {seen:?}");
        }
        let left: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
        assert!(left.is_empty(), "left in the cache: {left:?}");
    }
    // And the same data prepares whole afterwards.
    let p = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert_eq!(p.samples, 5000);
}

/// A data cache that is a file is named as such; before, the error was the file made under it
/// ("File exists").
#[test]
fn a_data_cache_that_is_a_file_is_refused_naming_it() {
    let d = Dir::new("cachefile");
    let input = d.file("ok.jsonl", b"{\"input_ids\": [1, 2]}\n");
    let cache = d.file("cache", b"not a directory");
    let err = prepare(&input, 8, &cache, None, &mut crate::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&cache.display().to_string()) && err.contains("this is not one"),
        "{err}"
    );
    assert_eq!(std::fs::read(&cache).unwrap(), b"not a directory");
}

/// A preparation killed by Ctrl-C (before the launcher handles signals) left its temporary
/// file, as big as the prepared file, in the cache; the next preparation of the same data
/// removes it, and leaves alone one whose writer still runs.
#[test]
fn a_killed_preparations_temporary_file_is_removed_by_the_next() {
    let d = Dir::new("killed");
    let input = d.file("data.jsonl", jsonl_of(&samples(3)).as_bytes());
    let cache = d.0.join("cache");
    let first = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    std::fs::remove_file(&first.path).unwrap();
    let name = first
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let killed = cache.join(format!(".{name}.{}.Ab12Cd.tmp", child.id()));
    let working = cache.join(format!(".{name}.{}.Ef34Gh.tmp", std::process::id()));
    std::fs::write(&killed, b"half a file").unwrap();
    std::fs::write(&working, b"a writer at work").unwrap();
    let again = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert_eq!(again.path, first.path);
    assert!(!killed.exists(), "the killed preparation's file is gone");
    assert!(working.exists(), "a running writer's file is left");
}

/// Changes sample 0's one id (0 to 9): the same size, and the modification time put back.
fn edit_keeping_size_and_mtime(input: &Path, text: &str) {
    let changed = text.replacen("\"input_ids\": [0]", "\"input_ids\": [9]", 1);
    assert!(changed.len() == text.len() && changed != text);
    let t = std::fs::metadata(input).unwrap().modified().unwrap();
    std::fs::write(input, &changed).unwrap();
    let f = std::fs::File::options().write(true).open(input).unwrap();
    f.set_modified(t).unwrap();
}

#[test]
fn the_cache_is_reused_for_the_same_bytes_and_not_for_changed_ones() {
    let d = Dir::new("cache");
    let cache = d.0.join("cache");
    let text = jsonl_of(&samples(50));
    let input = d.file("train.jsonl", text.as_bytes());
    let first = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(!first.reused);
    assert_eq!(first.kind, Kind::Jsonl);
    let mtime = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let made = mtime(&first.path);

    // The same bytes: the same file, not written again.
    let again = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(again.reused);
    assert_eq!(
        (again.path.clone(), mtime(&again.path)),
        (first.path.clone(), made)
    );
    // The same bytes under another name: still the same content.
    let copy = d.file("copy.jsonl", text.as_bytes());
    assert_eq!(
        prepare(&copy, 512, &cache, None, &mut crate::quiet)
            .unwrap()
            .path,
        first.path
    );

    // One id changed, same size and modification time: converted again, to another file.
    edit_keeping_size_and_mtime(&input, &text);
    let third = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(!third.reused);
    assert_ne!(third.path, first.path);
    assert_eq!(read_all(&Mapped::open(&third.path).unwrap())[0].0[0], 9);

    // Another max_len decides other refusals: another key.
    let fourth = prepare(&input, 4096, &cache, None, &mut crate::quiet).unwrap();
    assert!(!fourth.reused);
    assert_ne!(fourth.path, third.path);
}

#[test]
fn a_truncated_or_foreign_cache_file_is_a_clear_error() {
    let d = Dir::new("bad-cache");
    let cache = d.0.join("cache");
    let input = d.file("train.jsonl", jsonl_of(&samples(50)).as_bytes());
    let p = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    let good = std::fs::read(&p.path).unwrap();

    std::fs::write(&p.path, &good[..good.len() / 2]).unwrap();
    let err = prepare(&input, 512, &cache, None, &mut crate::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&*p.path.to_string_lossy()) && err.contains("truncated or not hspipe's"),
        "{err}"
    );

    std::fs::write(&p.path, b"{\"input_ids\": [1]}\n").unwrap();
    let err = prepare(&input, 512, &cache, None, &mut crate::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not an Arrow IPC file") && err.contains("delete it"),
        "{err}"
    );

    // A good prepared file of other data, under this input's key.
    let other = d.file("other.jsonl", b"{\"input_ids\": [1]}\n");
    let o = prepare(&other, 512, &cache, None, &mut crate::quiet).unwrap();
    std::fs::copy(&o.path, &p.path).unwrap();
    let err = prepare(&input, 512, &cache, None, &mut crate::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("the data of key {}", o.key)) && err.contains(&p.key),
        "{err}"
    );
}

#[test]
fn a_prepared_file_given_as_input_is_used_as_it_is() {
    let d = Dir::new("direct");
    let input = d.file("train.jsonl", jsonl_of(&samples(20)).as_bytes());
    let out = d.0.join("train.arrow");
    let p = prepare(
        &input,
        512,
        &d.0.join("unused"),
        Some(&out),
        &mut crate::quiet,
    )
    .unwrap();
    assert_eq!(p.path, out);
    assert!(!d.0.join("unused").exists());
    let q = prepare(&out, 512, &d.0.join("unused"), None, &mut crate::quiet).unwrap();
    assert_eq!(
        (q.path.clone(), q.reused, q.key.clone()),
        (out.clone(), true, p.key.clone())
    );
    assert_eq!(q.kind, Kind::ArrowFile { prepared: true });
    // Under a smaller max_len its longest sample is refused, by row.
    let longest = samples(20).iter().map(|s| s.0.len()).max().unwrap();
    let err = prepare(&out, 10, &d.0.join("unused"), None, &mut crate::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train.arrow: row ") && err.contains("more than data.max_len 10"),
        "{err} ({longest})"
    );
}

/// `launcher prepare train.jsonl -o train.jsonl` (a slip of tab completion) replaced the data
/// with its prepared file, the JSONL gone; now the output is refused when it is the input (by
/// any path to it) and the input stays as it was.
#[test]
fn an_output_file_that_is_the_input_is_refused_and_the_input_kept() {
    let d = Dir::new("outin");
    let text = jsonl_of(&samples(5));
    let input = d.file("train.jsonl", text.as_bytes());
    let link = d.0.join("link.jsonl");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    for out in [input.clone(), link, d.0.join(".").join("train.jsonl")] {
        let err = prepare(
            &input,
            512,
            &d.0.join("unused"),
            Some(&out),
            &mut crate::quiet,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("it is the input") && err.contains("name another output file"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&input).unwrap(), text);
    }
}

#[test]
fn an_unchanged_input_is_not_read_again_and_any_write_to_it_is_seen() {
    let d = Dir::new("stamp");
    let cache = d.0.join("cache");
    let text = jsonl_of(&samples(50));
    let input = d.file("train.jsonl", text.as_bytes());
    // A stamp is only written for files whose times are over 2 s old (a write in the same
    // tick as the stamp could go unseen otherwise): let them age.
    std::thread::sleep(std::time::Duration::from_millis(2200));
    let first = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(!first.reused && !first.key_from_stamp);
    let mut hashed = false;
    let again = prepare(&input, 512, &cache, None, &mut |p| {
        hashed |= p.stage == crate::Stage::Hashing;
        std::ops::ControlFlow::Continue(())
    })
    .unwrap();
    assert!(
        again.reused && again.key_from_stamp && !hashed,
        "not read again"
    );
    assert_eq!(
        (again.path.clone(), again.key.clone()),
        (first.path.clone(), first.key.clone())
    );

    // One byte changed, size and modification time put back: the change time moved, so the
    // stamp does not match; hashed, converted again.
    edit_keeping_size_and_mtime(&input, &text);
    let third = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(!third.reused && !third.key_from_stamp);
    assert_ne!(third.key, first.key);
    // Its times are fresh: no stamp was trusted or written, so it is hashed again.
    let fourth = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(fourth.reused && !fourth.key_from_stamp);
    assert_eq!(fourth.key, third.key);
}

/// What the hand-written writer before arrow-rs made, format version 1 as now: the samples of
/// `samples(40)` in record batches of about 1,500 tokens, under the content key that build
/// computed for `jsonl_of(samples(40))` with max_len 512 (written by that writer, kept as it
/// wrote it). That key came from twox-hash 1.6's XXH3-128, which differs from the reference
/// (`the_content_key_is_the_reference_xxh3_128`), so today's key for the same input is another.
const V1_FILE: &[u8] = include_bytes!("../testdata/v1-hspipe-writer.arrow");

/// A prepared file of another format version is refused, naming both versions: it was mapped
/// as if it were this build's.
#[test]
fn a_prepared_file_of_another_format_version_is_refused() {
    let d = Dir::new("ver");
    let p = d.0.join("v2.arrow");
    let f = std::fs::File::create(&p).unwrap();
    let mut w = Writer::new(f, vec![("hspipe.dataset".into(), "2".into())]).unwrap();
    w.push(&[1, 2, 3], None).unwrap();
    w.finish(Vec::new()).unwrap();
    let err = Mapped::open(&p).err().unwrap().to_string();
    assert!(
        err.contains("format version \"2\"") && err.contains("reads version \"1\""),
        "{err}"
    );
}

/// A prepared file of the earlier build still maps to the same samples, and passed as the data
/// itself (`--data file.arrow`) is used as it is, under the key it records. In a cache its old
/// key is not today's, so the same input is prepared again beside it, never mixed up with it.
#[test]
fn a_file_the_earlier_writer_prepared_still_maps_and_serves_as_data() {
    let d = Dir::new("v1");
    let data = samples(40);
    let old = d.file("old.arrow", V1_FILE);
    let m = Mapped::open(&old).unwrap();
    assert_eq!(read_all(&m), data);
    assert_eq!(m.meta("hspipe.dataset"), Some(crate::FORMAT_VERSION));
    assert!(m.record_batches() >= 4, "{}", m.record_batches());
    let old_key = m.meta("hspipe.key").unwrap().to_string();

    let as_data = prepare(&old, 512, &d.0.join("unused"), None, &mut crate::quiet).unwrap();
    assert!(
        as_data.reused && as_data.path == old && as_data.key == old_key,
        "{as_data:?}"
    );

    let input = d.file("train.jsonl", jsonl_of(&data).as_bytes());
    let cache = d.0.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(cache.join(format!("{old_key}.arrow")), V1_FILE).unwrap();
    let q = prepare(&input, 512, &cache, None, &mut crate::quiet).unwrap();
    assert!(!q.reused && q.key != old_key, "{q:?}");
    // arrow-rs writes other bytes for the same samples (its own padding and FlatBuffer layout).
    assert_ne!(std::fs::read(&q.path).unwrap(), V1_FILE);
    assert_eq!(read_all(&Mapped::open(&q.path).unwrap()), data);
}

#[test]
fn a_damaged_arrow_stream_or_file_input_is_an_error_not_a_panic() {
    let d = Dir::new("damaged-input");
    let p = d.0.join("x.arrow");
    write(&p, &samples(12), 300);
    let file = std::fs::read(&p).unwrap();
    let stream = file[stream_start(&file)..].to_vec();
    let convert = |bytes: &[u8], kind: &Kind| {
        let q = d.file("input", bytes);
        let mut w = Writer::new(std::io::sink(), Vec::new()).unwrap();
        let maker = crate::records::Maker {
            max_len: 512,
            too_long: crate::TooLong::Drop,
            chat: None,
            no_tokenizer_in: None,
        };
        crate::convert::convert(
            &q,
            kind,
            &maker,
            &mut w,
            &mut |_| std::ops::ControlFlow::Continue(()),
            &mut |_| {},
        )
    };
    assert!(convert(&stream, &Kind::ArrowStream).is_ok());
    assert!(convert(&file, &Kind::ArrowFile { prepared: false }).is_ok());
    for (bytes, kind) in [
        (&stream, Kind::ArrowStream),
        (&file, Kind::ArrowFile { prepared: false }),
    ] {
        for cut in (0..bytes.len()).step_by(17) {
            if let Err(e) = convert(&bytes[..cut], &kind) {
                assert!(e.to_string().contains("input"), "{e}");
            }
        }
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.clone();
            b[i] ^= 0x5a;
            let _ = convert(&b, &kind);
        }
    }
}

#[test]
fn the_writer_fills_the_same_buffers_for_every_record_batch() {
    let mut w = Writer::new(std::io::sink(), Vec::new())
        .unwrap()
        .batch_tokens(1000);
    for (ids, mask) in samples(200) {
        w.push(&ids, mask.as_deref()).unwrap();
    }
    // Arrow handed back every batch's buffers once it had written them (a new 16 MiB vector
    // per batch raised the peak of a long conversion by 4 MiB: see `Writer::flush`).
    assert!(w.tokens > 20 * 1000, "many batches");
    assert_eq!(w.fresh_buffers(), 0);
}

/// The content key is XXH3-128 as its reference implementation computes it (the C library,
/// here through Python's `xxhash` package, 2026-12-01): twox-hash 1.6, which computed it until
/// then, gave another value for inputs like this one (streamed in pieces, longer than 240
/// bytes), so keys of an earlier build do not match; its prepared files are simply prepared
/// again, and its runs could not be resumed anyway (`proto::plan::PLAN_VERSION` moved too).
#[test]
fn the_content_key_is_the_reference_xxh3_128() {
    let dir = Dir::new("xxh3");
    let body: String = (0..2000)
        .map(|i| format!("{{\"input_ids\":[{i},{}]}}\n", i * 7 % 1000))
        .collect();
    let input = dir.file("keyed.jsonl", body.as_bytes());
    let key = crate::cache::content_key(
        &input,
        &Kind::Jsonl,
        &crate::Options::new(4096),
        &mut crate::quiet,
    )
    .unwrap();
    assert_eq!(key, "a879f63fefaa4e4b95bf0376da3690e9");
}

/// A run's workers map its prepared file by path; one replaced there since the run was planned
/// (another key) is refused with both keys named, and the run's own file loads.
#[test]
fn a_prepared_file_of_another_key_than_the_runs_is_refused() {
    let d = Dir::new("key");
    let text = b"{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\n";
    let input = d.file("in.jsonl", text);
    let out = d.0.join("prepared.arrow");
    let p = prepare(
        &input,
        64,
        &d.0.join("cache"),
        Some(&out),
        &mut crate::quiet,
    )
    .unwrap();
    let synthetic = crate::Synthetic {
        samples: 1,
        min_len: 1,
        max_len: 1,
        seed: 1,
        vocab: 10,
        language: false,
    };
    let load = |key: Option<&str>| crate::Dataset::load(Some(&out), key, None, synthetic);
    assert_eq!(load(Some(&p.key)).unwrap().len(), 2);
    assert_eq!(load(None).unwrap().len(), 2);
    let other = "0".repeat(32);
    let e = load(Some(&other)).err().expect("refused").to_string();
    assert!(
        e.contains(&format!(
            "it holds the data of key {}, not the run's key {other}",
            p.key
        )) && e.contains(&out.display().to_string()),
        "{e}"
    );
}
