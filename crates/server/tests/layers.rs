//! The server's modules form layers: no import loop among its files (issue 12). Each module's
//! non-test code names the modules it uses as `crate::<module>`; this test reads them from the
//! sources and fails on any cycle, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module → the modules its non-test code names (`core/*.rs` count as `core`).
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for dir in [src.clone(), src.join("core")] {
        for entry in std::fs::read_dir(&dir).expect("src") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files {
        let rel = path.strip_prefix(&src).expect("under src");
        let module = rel.iter().next().expect("name").to_string_lossy();
        let module = module.trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(&path).expect("read");
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let uses = graph.entry(module.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            let name: String = code[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                uses.insert(name);
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

#[test]
fn the_server_has_no_import_loop() {
    let graph = imports();
    assert!(
        graph.contains_key("core") && graph.contains_key("conn"),
        "{graph:?}"
    );
    for module in graph.keys() {
        if let Some(cycle) = path_to(&graph, module, module, &mut BTreeSet::new()) {
            panic!("import loop: {module} -> {}", cycle.join(" -> "));
        }
    }
}
