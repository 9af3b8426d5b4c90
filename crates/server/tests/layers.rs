//! Every crate's modules form layers: no import loop among its files (issue 12 for the server,
//! issue 28 for every crate). Each module's non-test code names the modules it uses as
//! `crate::<module>` (or `crate::{a, b::c}`, doc links included); this test reads them from the
//! sources of every crate under `crates/` and fails on any loop, naming it.
//!
//! A file under a module's directory (`core/*.rs`, `proxy/meter.rs`) counts as that module;
//! `bin/` holds other crates' roots and is skipped. The crates still to be layered are listed in
//! `NOT_YET`: each of them must still have a loop (so the list shrinks as they are fixed), and
//! every other crate must have none.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Crates whose files still import one another in a loop (docs/TESTING.md, issue 28).
const NOT_YET: &[&str] = &["cli", "harness", "kernel", "ledger", "protocol", "sim"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "bin") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The modules one `crate::` path names: `crate::a::…` names `a`; `crate::{a, b::c}` names both.
fn named(rest: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    match rest.strip_prefix('{') {
        Some(group) => group
            .split('}')
            .next()
            .unwrap_or("")
            .split(',')
            .map(ident)
            .collect(),
        None => vec![ident(rest)],
    }
}

/// Module → the modules its non-test code names, for the crate at `src`.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files {
        let rel = path.strip_prefix(src).expect("under src");
        let module = rel.iter().next().expect("name").to_string_lossy();
        let module = module.trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(&path).expect("read");
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let uses = graph.entry(module.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            for name in named(&code[i + 7..]) {
                if !name.is_empty() && name != module && name != "self" {
                    uses.insert(name);
                }
            }
        }
    }
    graph
}

/// A path from `from` back to `to`, if there is one.
fn path_to(
    graph: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    for next in graph.get(from).into_iter().flatten() {
        if next == to {
            return Some(vec![next.clone()]);
        }
        if seen.insert(next.clone())
            && let Some(mut rest) = path_to(graph, next, to, seen)
        {
            rest.insert(0, next.clone());
            return Some(rest);
        }
    }
    None
}

/// A loop of the crate at `src`, as `a -> b -> a`.
fn a_loop(src: &Path) -> Option<String> {
    let graph = imports(src);
    graph.keys().find_map(|module| {
        path_to(&graph, module, module, &mut BTreeSet::new())
            .map(|cycle| format!("{module} -> {}", cycle.join(" -> ")))
    })
}

fn crates() -> Vec<(String, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut all: Vec<(String, PathBuf)> = std::fs::read_dir(&root)
        .expect("crates")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("src").is_dir())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                p.join("src"),
            )
        })
        .collect();
    all.sort();
    all
}

#[test]
fn the_server_has_no_import_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = imports(&src);
    assert!(
        graph.contains_key("core") && graph.contains_key("conn"),
        "{graph:?}"
    );
    if let Some(l) = a_loop(&src) {
        panic!("import loop in the server: {l}");
    }
}

#[test]
fn no_crate_outside_the_list_has_an_import_loop() {
    let all = crates();
    assert!(all.len() >= 12, "{all:?}");
    let mut found = Vec::new();
    for (name, src) in &all {
        match (a_loop(src), NOT_YET.contains(&name.as_str())) {
            (Some(l), false) => found.push(format!("{name}: {l}")),
            (None, true) => found.push(format!(
                "{name} has no import loop any more: take it off NOT_YET"
            )),
            _ => {}
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The reader sees a grouped import (the first version of this test did not).
#[test]
fn a_grouped_import_names_each_module() {
    assert_eq!(named("{api, events::stream, ui};"), ["api", "events", "ui"]);
    assert_eq!(named("quota::Full;"), ["quota"]);
}
