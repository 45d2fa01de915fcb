//! The house rules that a machine can check, read from ARCHITECTURE.md's "Rules a test checks"
//! section, so the document and the tree cannot drift apart: a file over 500 lines says why at
//! its top, `unsafe` and `libc` appear only in the files listed there, and every listed file
//! still needs its place on the list.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const LONG: usize = 500;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

/// Every Rust source of the workspace, relative to its root: build outputs, virtual
/// environments and hidden folders (`.git`, `.deps`, `.venv`) left out.
fn rust_files() -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if !(name.starts_with('.') || name == "target" || name == "runs") {
                    walk(&p, root, out);
                }
            } else if name.ends_with(".rs") {
                out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &root(), &mut out);
    out
}

/// The files a rule of ARCHITECTURE.md lists: the backticked paths on its line that starts with
/// `prefix` (a rule is one line).
fn listed(prefix: &str) -> BTreeSet<String> {
    let doc = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let line = doc
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("ARCHITECTURE.md has no line starting {prefix:?}"));
    line.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.ends_with(".rs"))
        .map(str::to_string)
        .collect()
}

/// The code of a line, without its `//` comment (a rough cut, enough for Rust as we write it:
/// no string literal of ours holds `//` before the words these rules look for).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

fn has_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

/// The files whose code (not their comments) uses `word`; this file's own examples of the
/// rules' reading are not uses.
fn files_using(word: &str) -> BTreeSet<String> {
    rust_files()
        .into_iter()
        .filter(|f| f != "tests/tests/tidy.rs")
        .filter(|f| {
            let text = std::fs::read_to_string(root().join(f)).unwrap();
            text.lines().any(|l| has_word(code(l), word))
        })
        .collect()
}

/// What is wrong with a rule's list, if anything: files that use the word but are not listed,
/// and listed files that no longer use it.
fn mismatch(rule: &str, used: &BTreeSet<String>, listed: &BTreeSet<String>) -> Option<String> {
    let unlisted: Vec<_> = used.difference(listed).collect();
    let stale: Vec<_> = listed.difference(used).collect();
    (!unlisted.is_empty() || !stale.is_empty()).then(|| {
        format!(
            "{rule}: used but not listed in ARCHITECTURE.md: {unlisted:?}; listed but no longer \
             used (take them off the list): {stale:?}"
        )
    })
}

#[test]
fn a_file_over_500_lines_says_why_at_its_top() {
    let mut silent = Vec::new();
    for f in rust_files() {
        let text = std::fs::read_to_string(root().join(&f)).unwrap();
        let lines = text.lines().count();
        // The reason is a paragraph of the module doc that starts "Length:".
        let says_why = text
            .lines()
            .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
            .any(|l| {
                l.trim_start_matches("//!")
                    .trim_start()
                    .starts_with("Length:")
            });
        if lines > LONG && !says_why {
            silent.push(format!("{f} ({lines} lines)"));
        }
    }
    assert!(
        silent.is_empty(),
        "files over {LONG} lines without a `//! Length:` paragraph in their module doc saying \
         why: {silent:?}"
    );
}

#[test]
fn unsafe_is_only_in_the_listed_files() {
    let wrong = mismatch(
        "unsafe",
        &files_using("unsafe"),
        &listed("- `unsafe` only in:"),
    );
    assert!(wrong.is_none(), "{}", wrong.unwrap());
}

#[test]
fn libc_is_only_in_the_listed_files() {
    let wrong = mismatch("libc", &files_using("libc"), &listed("- `libc` only in:"));
    assert!(wrong.is_none(), "{}", wrong.unwrap());
}

/// The rules' own reading: a word in a comment does not count, a word inside a longer
/// identifier does not either, and a path off the list is named.
#[test]
fn the_rules_read_code_not_comments() {
    assert!(has_word(code("    let r = unsafe { f() };"), "unsafe"));
    assert!(!has_word(
        code("    // unsafe { f() } would be wrong here"),
        "unsafe"
    ));
    assert!(!has_word(
        code("    recover_unchecked_unsafe_free();"),
        "unsafe"
    ));
    assert!(has_word(code("use libc::wait4;"), "libc"));
    let used: BTreeSet<String> = ["a.rs".to_string()].into();
    let listed: BTreeSet<String> = ["b.rs".to_string()].into();
    let msg = mismatch("unsafe", &used, &listed).expect("both lists differ");
    assert!(
        msg.contains("[\"a.rs\"]") && msg.contains("[\"b.rs\"]"),
        "{msg}"
    );
    assert_eq!(mismatch("unsafe", &used, &used), None);
}
