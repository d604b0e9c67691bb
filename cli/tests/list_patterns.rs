//! `list PATTERN` with the escaped form NAME arguments take: a name that is not UTF-8 is
//! found by a pattern, an escaped byte matches itself (also one that the glob would read
//! as a wildcard), the glob's own escapes (`\*`, `\\`) mean what they meant, and a
//! pattern's open end (a lone backslash, an unclosed class) means what the glob reads.

mod support;

use redbaton::LockGuard;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use serde_json::Value;

use support::{client, code, redbaton, run, stderr, stdout};

/// The names `list PATTERN --json` shows (in their escaped form), sorted; exit 0.
fn listed(url: &str, pattern: &str) -> Vec<String> {
    let o = redbaton(url, &["list", pattern, "--json"]);
    assert_eq!(code(&o), 0, "{pattern}: {}", stderr(&o));
    let mut names: Vec<String> = stdout(&o)
        .lines()
        .map(|l| {
            let line: Value = serde_json::from_str(l).expect("a JSON line");
            line["name"].as_str().expect("a name").to_owned()
        })
        .collect();
    names.sort();
    names
}

/// The locks of `names`, held until the guards are dropped.
fn hold(srv: &RedisServer, names: &[&[u8]]) -> Vec<LockGuard> {
    let c = client(srv);
    names.iter().map(|n| c.lock(n).expect("lock")).collect()
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv);
    let _g = c.lock("jobs:1").expect("lock");
    assert_eq!(listed(&srv.url(), "jobs:*"), ["jobs:1"]);
}

/// A name that is not UTF-8 is found by its escaped form with a wildcard, and so is the
/// ASCII name that reads like it (a backslash, `xff`), each by its own pattern.
#[test]
fn a_non_utf8_name_is_found_by_its_escaped_pattern() {
    let srv = test_server();
    let _held = hold(&srv, &[b"\xffjob", br"\xffjob", b"job"]);
    let url = srv.url();
    assert_eq!(listed(&url, r"\xff*"), [r"\xffjob"]);
    assert_eq!(listed(&url, r"\xffj?b"), [r"\xffjob"]);
    assert_eq!(listed(&url, r"\\xff*"), [r"\\xffjob"]);
    assert_eq!(listed(&url, "*job"), [r"\\xffjob", r"\xffjob", "job"]);
    // Every name `list` shows, given back as the pattern, finds that name.
    for shown in listed(&url, "*") {
        assert!(listed(&url, &shown).contains(&shown), "{shown}");
    }
}

/// An escaped byte is that byte, even one the glob reads as a wildcard (`\x2a` is `*`);
/// the glob's escapes and wildcards keep their meaning.
#[test]
fn an_escaped_byte_matches_itself() {
    let srv = test_server();
    let _held = hold(&srv, &[b"a*b", b"axb", b"a\tb"]);
    let url = srv.url();
    assert_eq!(listed(&url, r"a\x2ab"), ["a*b"]);
    assert_eq!(listed(&url, r"a\*b"), ["a*b"]);
    assert_eq!(listed(&url, r"a\tb"), [r"a\tb"]);
    assert_eq!(listed(&url, "a?b"), ["a*b", r"a\tb", "axb"]);
}

/// A pattern with a bad escape of a byte or a character is a usage error that says how
/// to write a backslash; the help says which escapes a pattern takes.
#[test]
fn a_bad_escape_in_a_pattern_is_a_usage_error() {
    let srv = test_server();
    for pattern in [r"job\xzz", r"job\u{d800}*"] {
        let o = redbaton(&srv.url(), &["list", pattern]);
        let err = stderr(&o);
        assert!(code(&o) == 2 && err.contains(r"`\\`"), "{pattern}: {err}");
        support::no_panic(&o);
    }
    let help = stdout(&run(&["list", "--help"]));
    assert!(help.contains(r"\xNN"), "{help}");
}

/// A pattern that ends in a lone backslash (the glob reads it as a backslash) or in an
/// unclosed class lists the names the glob matches.
#[test]
fn a_pattern_with_an_open_end_lists_what_it_matches() {
    let srv = test_server();
    let _held = hold(&srv, &[b"end\\", b"b"]);
    let url = srv.url();
    assert_eq!(listed(&url, r"end\"), [r"end\\"]);
    assert_eq!(listed(&url, "[ab"), ["b"]);
}
