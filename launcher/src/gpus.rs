//! GPU lists on the command line: `0-4`, `0,2,4`, `0-2,6`.

/// Most GPU index accepted.
const MAX_GPU: u32 = 1023;

/// A parsed GPU list, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuList(pub Vec<u32>);

/// clap's value parser for `--targets` and `--drafters`.
pub fn gpu_list_arg(s: &str) -> Result<GpuList, String> {
    parse_gpu_list(s).map(GpuList)
}

/// Parses a GPU list; the error says what is wrong with it.
pub fn parse_gpu_list(s: &str) -> Result<Vec<u32>, String> {
    if s.trim().is_empty() {
        return Err("the GPU list is empty (write e.g. 0-4, 0,2,4 or 0-2,6)".into());
    }
    let mut out: Vec<u32> = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("{s:?} has an empty entry between commas"));
        }
        let num = |t: &str| -> Result<u32, String> {
            let n: u32 = t
                .trim()
                .parse()
                .map_err(|_| format!("{t:?} in {s:?} is not a GPU number"))?;
            if n > MAX_GPU {
                return Err(format!("GPU {n} is out of range (at most {MAX_GPU})"));
            }
            Ok(n)
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(part)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("range {part:?} is reversed (write {hi}-{lo})"));
        }
        for g in lo..=hi {
            if out.contains(&g) {
                return Err(format!("GPU {g} is listed twice in {s:?}"));
            }
            out.push(g);
        }
    }
    Ok(out)
}

/// GPUs in both lists, if any.
pub fn overlap(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().copied().filter(|g| b.contains(g)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ranges_lists_and_mixes() {
        assert_eq!(parse_gpu_list("0-4").unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(parse_gpu_list("0,2,4").unwrap(), vec![0, 2, 4]);
        assert_eq!(parse_gpu_list("0-2,6").unwrap(), vec![0, 1, 2, 6]);
        assert_eq!(parse_gpu_list("7").unwrap(), vec![7]);
    }

    #[test]
    fn refuses_bad_lists_saying_why() {
        let cases = [
            ("", "empty"),
            ("  ", "empty"),
            ("4-0", "reversed"),
            ("a", "not a GPU number"),
            ("1-", "not a GPU number"),
            ("-3", "not a GPU number"),
            ("0,,1", "empty entry"),
            ("0,0", "listed twice"),
            ("0-2,1", "listed twice"),
            ("5000", "out of range"),
        ];
        for (s, want) in cases {
            let err = parse_gpu_list(s).unwrap_err();
            assert!(err.contains(want), "{s:?}: {err:?} should say {want:?}");
        }
    }

    #[test]
    fn overlap_names_shared_gpus() {
        assert_eq!(overlap(&[0, 1, 2], &[2, 3]), vec![2]);
        assert!(overlap(&[0, 1], &[2, 3]).is_empty());
    }
}
