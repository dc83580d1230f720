//! Keeps docs/architecture.md's layer table true: reads every file under
//! `src/`, collects the `crate::<module>` paths it names and fails on one its
//! folder's row does not allow, fails on any function longer than the
//! project's limit, and fails when the modules of any folder import each other in a circle. Plain text scanning (comments and string literals are
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
            "service", "broker", "pipeline", "messages", "config", "image", "metrics", "node",
            "seal", "error",
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
            "seal", "clock", "error",
        ],
    ),
    (
        "dispatch",
        &["pipeline", "messages", "metrics", "node", "clock", "error"],
    ),
    (
        "rpc",
        &[
            "dispatch", "http", "messages", "node", "fsutil", "clock", "error",
        ],
    ),
    (
        "pipeline",
        &[
            "sources",
            "image",
            "image_format",
            "store",
            "messages",
            "metrics",
            "config",
            "node",
            "fsutil",
            "peers",
            "secrets",
            "clock",
            "error",
        ],
    ),
    ("messages", &["node", "error"]),
    (
        "sources",
        &[
            "messages", "config", "retry", "fsutil", "peers", "secrets", "error",
        ],
    ),
    ("image", &["image_format", "store", "fsutil", "error"]),
    (
        "store",
        &[
            "config",
            "image_format",
            "node",
            "fsutil",
            "gzip",
            "optional_digest",
            "clock",
            "error",
        ],
    ),
    ("http", &["metrics", "fsutil", "peers", "gzip", "error"]),
    ("metrics", &["messages"]),
    (
        "config",
        &[
            "image",
            "image_format",
            "store",
            "node",
            "fsutil",
            "secrets",
            "seal",
            "error",
        ],
    ),
    ("fsutil", &["error"]),
    ("gzip", &[]),
    ("secrets", &[]),
    ("node", &["error"]),
    (
        "peers",
        &["image_format", "optional_digest", "seal", "clock"],
    ),
    ("clock", &[]),
    ("seal", &[]),
    ("image_format", &[]),
    ("optional_digest", &[]),
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

/// The names a `{...}` use list right after `at` holds, at its top level
/// (`a`, `b` of `{a, b::{C, D}}`).
fn listed(code: &str, at: usize) -> Vec<String> {
    let mut names = Vec::new();
    let (mut depth, mut item) = (0usize, String::new());
    for c in code[at..].chars() {
        match c {
            '{' => depth += 1,
            '}' | ',' if depth == 1 => {
                names.push(std::mem::take(&mut item));
                if c == '}' {
                    break;
                }
                continue;
            }
            '}' => depth -= 1,
            _ => {}
        }
        if depth == 1 && c != '{' {
            item.push(c);
        }
    }
    names
        .iter()
        .map(|i| i.trim().split("::").next().unwrap_or("").trim().to_string())
        .collect()
}

/// The names following each `prefix` in `code` (`x` of `prefix x::...`
/// and each top-level name of `prefix {x, y::Z}`), not counting a prefix
/// that is the tail of a longer path.
fn named_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let before = &code[..at];
        if ident(code.as_bytes(), at) || before.ends_with("::") {
            continue;
        }
        let rest = &code[at + prefix.len()..];
        if rest.starts_with('{') {
            out.extend(listed(code, at + prefix.len()));
        } else {
            out.push(
                rest.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    out
}

/// The paths serde attributes name in strings (`deserialize_with =
/// "super::value::list"`): the compiler resolves them like code, the text
/// scanner would blank them out with every string.
fn serde_paths(src: &str) -> String {
    src.lines()
        .filter(|l| l.trim_start().starts_with("#[serde("))
        .map(|l| l.replace('"', " "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules of the folder `dir` under `src` (`dir/<name>.rs` or
/// `dir/<name>/`), as a graph from each module to the siblings its files
/// name: with `super::<name>` (`super::super::<name>` from a subfolder's
/// file) or by the folder's own path, `crate::<dir>::<name>` (`crate::<name>`
/// for `src` itself). The folder's root (`mod.rs`; `lib.rs` and `main.rs`
/// for `src`), which declares them all, is left out.
fn sibling_uses(src: &Path, dir: &Path) -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    let module = |f: &Path| module_of(dir, f);
    let roots = ["mod", "lib", "main"];
    let names: BTreeSet<String> = files
        .iter()
        .map(|f| module(f))
        .filter(|m| !roots.contains(&m.as_str()))
        .collect();
    let own_path: String = dir
        .strip_prefix(src)
        .unwrap()
        .components()
        .map(|c| format!("{}::", c.as_os_str().to_str().unwrap()))
        .collect();
    let mut graph = std::collections::BTreeMap::new();
    for file in &files {
        let from = module(file);
        if roots.contains(&from.as_str()) {
            continue;
        }
        let raw = std::fs::read_to_string(file).unwrap();
        let code = code_only(&raw) + "\n" + &serde_paths(&raw);
        // How many `super::` lead from this file's module to `dir`.
        let rel = file.strip_prefix(dir).unwrap();
        let depth = rel.components().count() - usize::from(rel.ends_with("mod.rs"));
        let mut found = named_after(&code, &format!("crate::{own_path}"));
        if depth > 0 {
            found.extend(named_after(&code, &"super::".repeat(depth)));
        }
        let uses: &mut BTreeSet<String> = graph.entry(from.clone()).or_default();
        uses.extend(
            found
                .into_iter()
                .filter(|n| *n != from && names.contains(n)),
        );
    }
    graph
}

/// A cycle in `graph`, if there is one, as the path that closes it.
fn find_cycle(graph: &std::collections::BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &std::collections::BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

/// Every folder under `dir`, `dir` included.
fn folders(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            folders(&path, out);
        }
    }
}

#[test]
fn each_folders_modules_use_each_other_in_one_direction() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    folders(&src, &mut all);
    all.sort();
    let mut circles = Vec::new();
    for dir in &all {
        let graph = sibling_uses(&src, dir);
        if let Some(cycle) = find_cycle(&graph) {
            let folder = dir.strip_prefix(&src).unwrap().display().to_string();
            circles.push(format!("src/{folder}: {}", cycle.join(" -> ")));
        }
    }
    assert!(
        circles.is_empty(),
        "modules that use each other in a circle:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_scanner_sees_every_way_a_sibling_is_named() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("pipeline");
    std::fs::create_dir_all(folder.join("masters")).unwrap();
    for (name, text) in [
        ("mod.rs", "mod a; mod b; mod c; mod d; mod masters;"),
        ("a.rs", "use super::{b::X, c};"),
        ("b.rs", "fn f() { crate::pipeline::d::g() }"),
        (
            "c.rs",
            "#[serde(deserialize_with = \"super::d::list\")]\nstruct S;",
        ),
        (
            "d.rs",
            "// super::a in a comment\nconst S: &str = \"super::a\";",
        ),
        ("masters/mod.rs", "use super::a;"),
        ("masters/e.rs", "use super::super::b;"),
    ] {
        std::fs::write(folder.join(name), text).unwrap();
    }
    let graph = sibling_uses(dir.path(), &folder);
    let uses = |m: &str| graph[m].iter().cloned().collect::<Vec<_>>();
    assert_eq!(uses("a"), ["b", "c"]);
    assert_eq!(uses("b"), ["d"]);
    assert_eq!(uses("c"), ["d"]);
    assert!(uses("d").is_empty());
    assert_eq!(uses("masters"), ["a", "b"]);
    // The real tree is scanned the same way: its folders are not empty.
    assert!(
        !sibling_uses(&src, &src.join("config"))
            .values()
            .all(BTreeSet::is_empty)
    );
}

#[test]
fn the_circle_finder_finds_circles() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = std::collections::BTreeMap::<String, BTreeSet<String>>::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    let circle = graph(&[
        ("attempt", "fetch"),
        ("fetch", "peers"),
        ("peers", "attempt"),
    ]);
    assert_eq!(find_cycle(&circle).map(|c| c.len()), Some(4), "{circle:?}");
    let line = graph(&[
        ("fetch", "peers"),
        ("peers", "attempt"),
        ("fetch", "attempt"),
    ]);
    assert_eq!(find_cycle(&line), None);
}
