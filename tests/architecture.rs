//! Keeps docs/architecture.md's layer table true: reads every file under
//! `src/`, collects the `crate::<module>` paths it names and fails on one its
//! folder's row does not allow, and fails on any function longer than the
//! project's limit. Plain text scanning (comments and string literals are
//! skipped), no compiler involved, so it runs in milliseconds.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Longest function body allowed in `src/`, in lines (signature to closing
/// brace).
const MAX_FN_LINES: usize = 80;

/// Functions still over the limit, to be split (`file:fn`). The list only
/// shrinks: a function not on it over the limit fails, and so does one on it
/// that is no longer over it (take it off).
const STILL_LONG: &[&str] = &[];

/// What each top-level module may name with `crate::`: the "uses" column of
/// docs/architecture.md's layer table. A module may always name itself.
const ALLOWED: &[(&str, &[&str])] = &[
    (
        "cli",
        &[
            "service", "broker", "pipeline", "messages", "config", "image", "metrics", "error",
        ],
    ),
    (
        "service",
        &[
            "broker", "dispatch", "rpc", "http", "pipeline", "sources", "metrics", "config",
            "error",
        ],
    ),
    (
        "broker",
        &[
            "dispatch", "pipeline", "messages", "metrics", "config", "retry", "peers", "secrets",
            "error",
        ],
    ),
    (
        "dispatch",
        &["pipeline", "messages", "metrics", "node", "error"],
    ),
    (
        "rpc",
        &["dispatch", "http", "messages", "node", "fsutil", "error"],
    ),
    (
        "pipeline",
        &[
            "sources", "image", "store", "messages", "metrics", "config", "node", "fsutil",
            "peers", "secrets", "error",
        ],
    ),
    ("messages", &["node", "error"]),
    (
        "sources",
        &[
            "messages", "config", "retry", "fsutil", "peers", "secrets", "error",
        ],
    ),
    ("image", &["store", "fsutil", "error"]),
    ("store", &["config", "node", "fsutil", "error"]),
    ("http", &["metrics", "fsutil", "peers", "error"]),
    ("metrics", &["messages"]),
    (
        "config",
        &["image", "store", "node", "fsutil", "secrets", "error"],
    ),
    ("fsutil", &["error"]),
    ("secrets", &[]),
    ("node", &["error"]),
    ("peers", &[]),
    ("retry", &[]),
    ("error", &[]),
    ("lib", &[]),
    ("main", &[]),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source with comments and the contents of string and character
/// literals blanked out (newlines kept, so line numbers stay right).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'#' | b'"')) && !ident(b, i) {
            // Raw string r#"..."#: find the matching number of hashes.
            let mut j = i + 1;
            while b.get(j) == Some(&b'#') {
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            out.extend(std::iter::repeat_n(b' ', j + 1 - i));
            i = j + 1;
            while i < b.len() {
                if b[i] == b'"'
                    && b[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    out.extend(std::iter::repeat_n(b' ', hashes + 1));
                    i += hashes + 1;
                    break;
                }
                blank(&mut out, b[i]);
                i += 1;
            }
        } else if c == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 3..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 3 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.extend(std::iter::repeat_n(b' ', e + 1 - i));
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// The top-level module a file under `src/` belongs to.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_str()
        .unwrap();
    first.trim_end_matches(".rs").to_string()
}

#[test]
fn each_layer_names_only_what_its_row_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut forbidden = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        let allowed = ALLOWED
            .iter()
            .find(|(m, _)| *m == module)
            .unwrap_or_else(|| panic!("{module} has no row in the layer table"))
            .1;
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        for (n, line) in code.lines().enumerate() {
            for (at, _) in line.match_indices("crate::") {
                if ident(line.as_bytes(), at) {
                    continue;
                }
                let name: String = line[at + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if name != module && !allowed.contains(&name.as_str()) {
                    forbidden.push(format!(
                        "{}:{}: {module} names crate::{name}",
                        file.strip_prefix(&src).unwrap().display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        forbidden.is_empty(),
        "imports the layer table (docs/architecture.md) does not allow:\n{}",
        forbidden.join("\n")
    );
}

/// Every function's length in lines, from the line of `fn` to its closing
/// brace.
fn function_lengths(code: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(at) = find_fn(line) else { continue };
        let name: String = line[at + 3..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // The body opens at the first `{` after the signature (a `;` first:
        // a declaration without a body).
        let mut depth = 0usize;
        let mut opened = false;
        let mut end = None;
        'scan: for (n, l) in lines.iter().enumerate().skip(start) {
            let from = if n == start { at } else { 0 };
            for c in l[from..].chars() {
                match c {
                    ';' if !opened => break 'scan,
                    '{' => {
                        opened = true;
                        depth += 1;
                    }
                    '}' if opened => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(n);
                            break 'scan;
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(end) = end {
            found.push((start + 1, name, end - start + 1));
        }
    }
    found
}

/// Where a line declares a function (`fn name`), if it does.
fn find_fn(line: &str) -> Option<usize> {
    let b = line.as_bytes();
    line.match_indices("fn ").map(|(at, _)| at).find(|&at| {
        !ident(b, at)
            && line[at + 3..]
                .trim_start()
                .starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
    })
}

#[test]
fn no_function_is_longer_than_the_limit() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut long = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for file in &files {
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let rel = file.strip_prefix(&src).unwrap().display().to_string();
        for (line, name, len) in function_lengths(&code) {
            let known = STILL_LONG.contains(&format!("{rel}:{name}").as_str());
            if len > MAX_FN_LINES && !known {
                long.insert(format!("{rel}:{line}: fn {name} is {len} lines"));
            }
            if known {
                seen.insert(format!("{rel}:{name}"));
                if len <= MAX_FN_LINES {
                    long.insert(format!(
                        "{rel}:{line}: fn {name} is short now: take it off STILL_LONG"
                    ));
                }
            }
        }
    }
    for known in STILL_LONG {
        if !seen.contains(*known) {
            long.insert(format!("{known}: gone: take it off STILL_LONG"));
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        long.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_scanner_sees_through_comments_and_strings() {
    let code = code_only(
        "// crate::x\nlet s = \"crate::y { \\\" }\"; let r = r#\"crate::z\"#; let c = '{';\nfn f<'a>() { crate::ok }\n",
    );
    assert!(!code.contains("crate::x") && !code.contains("crate::y") && !code.contains("crate::z"));
    assert!(code.contains("crate::ok"));
    assert_eq!(function_lengths(&code), vec![(3, "f".to_string(), 1)]);
    let two = code_only("fn g() {\n    if x { y }\n}\nfn h();\n");
    assert_eq!(function_lengths(&two), vec![(1, "g".to_string(), 3)]);
}
