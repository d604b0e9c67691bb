//! The source tree's layers: no import cycle among the modules of `src/`, and no lower
//! layer naming a higher one. Reads the source as text; needs no Redis.
//!
//! Run it alone with `cargo test --test layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. A file may name files of its own layer or of lower ones.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves",
        &[
            "error",
            "config",
            "fencing",
            "stats",
            "worker",
            "clock",
            "fault",
            "supervise",
        ],
    ),
    ("proto", &["proto"]),
    ("local, wake, topology", &["local", "wake", "topology"]),
    ("engine", &["engine"]),
    ("api", &["api"]),
];

#[test]
fn smoke() {
    let files = source_files();
    assert!(files.contains_key(&vec![]), "src/lib.rs found");
    assert!(files.len() > 10, "{} files", files.len());
}

#[test]
fn no_import_cycle_among_source_files() {
    let graph = graph();
    if let Some(cycle) = find_cycle(&graph) {
        let names: Vec<String> = cycle.iter().map(display).collect();
        panic!("import cycle: {}", names.join(" -> "));
    }
}

#[test]
fn no_lower_layer_names_a_higher_one() {
    let mut wrong = Vec::new();
    for (from, tos) in graph() {
        let Some(rank_from) = rank(&from) else {
            continue;
        };
        for to in tos {
            let Some(rank_to) = rank(&to) else { continue };
            if rank_to > rank_from {
                wrong.push(format!("{} names {}", display(&from), display(&to)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "upward dependencies:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_module_has_a_layer() {
    let missing: Vec<String> = source_files()
        .keys()
        .filter(|m| !m.is_empty() && rank(m).is_none())
        .map(display)
        .collect();
    assert!(missing.is_empty(), "not in any layer: {missing:?}");
}

type Module = Vec<String>;

fn rank(module: &Module) -> Option<usize> {
    let top = module.first()?;
    LAYERS
        .iter()
        .position(|(_, members)| members.contains(&top.as_str()))
}

fn display(module: &Module) -> String {
    if module.is_empty() {
        "crate".to_owned()
    } else {
        module.join("::")
    }
}

/// Every `.rs` file under `src/`, by module path (`src/a/mod.rs` and `src/a.rs` are `a`).
fn source_files() -> BTreeMap<Module, PathBuf> {
    fn walk(dir: &Path, prefix: &Module, out: &mut BTreeMap<Module, PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src/") {
            let path = entry.expect("dir entry").path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                let mut p = prefix.clone();
                p.push(path.file_name().unwrap().to_string_lossy().into_owned());
                walk(&path, &p, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let mut module = prefix.clone();
                if name != "mod" && name != "lib" {
                    module.push(name);
                }
                out.insert(module, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &vec![],
        &mut out,
    );
    out
}

/// File-level edges: which module files each module file names through `crate::` or
/// `super::` paths, outside comments and test modules.
fn graph() -> BTreeMap<Module, BTreeSet<Module>> {
    let files = source_files();
    let mut graph = BTreeMap::new();
    for (module, path) in &files {
        let text = std::fs::read_to_string(path).expect("read source");
        let mut edges = BTreeSet::new();
        for line in text.lines() {
            let line = line.trim_start();
            if line.starts_with("#[cfg(test)]") {
                break; // unit tests sit at the end of a file and may name anything
            }
            let code = line.split("//").next().unwrap_or("");
            for path in paths_in(code) {
                let base: Module = match path.first().map(String::as_str) {
                    Some("crate") => vec![],
                    Some("super") => {
                        let is_dir_module = path_is_dir_module(&files, module);
                        let mut m = module.clone();
                        if !is_dir_module {
                            m.pop();
                        }
                        m.pop();
                        m
                    }
                    _ => continue,
                };
                let target = resolve(&files, base, &path[1..]);
                if &target != module {
                    edges.insert(target);
                }
            }
        }
        graph.insert(module.clone(), edges);
    }
    graph
}

fn path_is_dir_module(files: &BTreeMap<Module, PathBuf>, module: &Module) -> bool {
    files[module]
        .file_name()
        .is_some_and(|n| n == "mod.rs" || n == "lib.rs")
}

/// The deepest module file that `base::segments` reaches.
fn resolve(files: &BTreeMap<Module, PathBuf>, mut base: Module, segments: &[String]) -> Module {
    for seg in segments {
        let mut next = base.clone();
        next.push(seg.clone());
        if files.contains_key(&next) {
            base = next;
        } else {
            break;
        }
    }
    base
}

/// The `crate::…` and `super::…` paths in a line of code, with `{a, b::c}` groups
/// expanded one path each.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for root in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(i) = rest.find(root) {
            let before = rest[..i].chars().last();
            rest = &rest[i..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                rest = &rest[root.len()..];
                continue;
            }
            let head = root.trim_end_matches("::").to_owned();
            expand(&rest[root.len()..], vec![head], &mut out);
            rest = &rest[root.len()..];
        }
    }
    out
}

fn expand(text: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let ident_end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    if ident_end == 0 {
        if let Some(group) = text.strip_prefix('{') {
            for item in split_group(group) {
                expand(item.trim(), prefix.clone(), out);
            }
        } else {
            out.push(prefix);
        }
        return;
    }
    let mut path = prefix;
    path.push(text[..ident_end].to_owned());
    match text[ident_end..].strip_prefix("::") {
        Some(more) => expand(more, path, out),
        None => out.push(path),
    }
}

/// The top-level items of a `{…}` group (the text after its `{`).
fn split_group(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items
}

fn find_cycle(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Option<Vec<Module>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        m: &Module,
        graph: &BTreeMap<Module, BTreeSet<Module>>,
        marks: &mut BTreeMap<Module, Mark>,
        stack: &mut Vec<Module>,
    ) -> Option<Vec<Module>> {
        match marks.get(m) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = stack.iter().position(|s| s == m).unwrap_or(0);
                let mut cycle = stack[start..].to_vec();
                cycle.push(m.clone());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(m.clone(), Mark::Open);
        stack.push(m.clone());
        for next in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, graph, marks, stack) {
                return Some(c);
            }
        }
        stack.pop();
        marks.insert(m.clone(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for m in graph.keys() {
        if let Some(c) = visit(m, graph, &mut marks, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

#[test]
fn the_checker_sees_groups_and_super() {
    assert_eq!(
        paths_in("use crate::a::{b::C, d};"),
        vec![
            vec!["crate".to_owned(), "a".into(), "b".into(), "C".into()],
            vec!["crate".to_owned(), "a".into(), "d".into()],
        ]
    );
    assert_eq!(
        paths_in("let x = super::f(1);"),
        vec![vec!["super".to_owned(), "f".into()]]
    );
    let mut g = BTreeMap::new();
    g.insert(vec!["a".to_owned()], BTreeSet::from([vec!["b".to_owned()]]));
    g.insert(vec!["b".to_owned()], BTreeSet::from([vec!["a".to_owned()]]));
    assert!(find_cycle(&g).is_some());
}
