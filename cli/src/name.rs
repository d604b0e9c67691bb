//! Lock names as the command line shows them and takes them back. Names are bytes; both
//! ways they are written in one escaped form, so that every name `list` prints can be
//! given back as a NAME argument:
//!
//! * `\\` for a backslash, `\n`, `\r` and `\t`;
//! * `\xNN` for the other ASCII control characters and for each byte that is not UTF-8;
//! * `\u{NNNN}` for the other control characters;
//! * every other character as it is.
//!
//! A `list` PATTERN is a Redis glob over names in that form too: the escapes that stand
//! for a byte or a character (`\n`, `\r`, `\t`, `\xNN`, `\u{NNNN}`) match it literally,
//! and the glob's own (`\*`, `\?`, `\[`, `\\`, ...) stay as they are. `\\` means a
//! backslash both ways, so a name as `list` shows it, given back as a pattern, finds it.

use std::fmt::Write as _;

/// What NAME arguments accept, for the help.
pub const NAME_HELP: &str = "The lock's name, as `list` shows it: `\\\\` for a backslash, \
`\\n`, `\\r`, `\\t`, `\\xNN` for a byte (names that are not UTF-8), `\\u{NNNN}` for a \
character";

/// What PATTERN arguments accept, for the help.
pub const PATTERN_HELP: &str = "A Redis glob over names (`*`, `?`, `[a-z]`, `\\` escapes \
the next character), with the escapes of NAME for what `list` shows escaped: `\\n`, \
`\\r`, `\\t`, `\\xNN` for a byte (names that are not UTF-8), `\\u{NNNN}` for a \
character, each matching itself";

/// A `list` PATTERN given on the command line: the glob's bytes, and the argument as given
/// (to say what matched nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    pub glob: Vec<u8>,
    pub shown: String,
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

/// A PATTERN argument: the escaped form back to a glob's bytes (clap's value parser). A
/// byte or a character given by an escape is escaped for the glob when the glob would
/// read it as a wildcard (`\x2a` is a `*` in the name, not any run of bytes); a backslash
/// before anything else is the glob's own escape, kept with what follows. A bad `\x` or
/// `\u` escape is refused as it is in a NAME.
pub fn parse_pattern(arg: &str) -> Result<Pattern, String> {
    let glob = walk(arg, |glob, escape| {
        if !escape.starts_with(['n', 'r', 't', 'x', 'u']) {
            // The glob's escape (`\\` included), or a backslash at the end, which the glob
            // takes as itself: as given.
            let used = escape.chars().next().map_or(0, char::len_utf8);
            glob.push(b'\\');
            glob.extend_from_slice(&escape.as_bytes()[..used]);
            return Ok(used);
        }
        let (literal, used) = unescape(escape).ok_or_else(|| bad_escape(escape))?;
        for b in literal.bytes() {
            if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
                glob.push(b'\\');
            }
            glob.push(b);
        }
        Ok(used)
    })?;
    Ok(Pattern {
        glob,
        shown: arg.to_owned(),
    })
}

/// `arg`'s bytes, each escape (what follows a backslash) given to `escaped`, which adds
/// what it stands for and says how much of it was the escape.
fn walk(
    arg: &str,
    mut escaped: impl FnMut(&mut Vec<u8>, &str) -> Result<usize, String>,
) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(at) = rest.find('\\') {
        bytes.extend_from_slice(&rest.as_bytes()[..at]);
        let escape = &rest[at + 1..];
        let used = escaped(&mut bytes, escape)?;
        rest = &escape[used..];
    }
    bytes.extend_from_slice(rest.as_bytes());
    Ok(bytes)
}

/// The message of an escape that `escape` (what follows a backslash) does not start.
fn bad_escape(escape: &str) -> String {
    format!(
        "bad escape at `\\{}`: write `\\\\` for a backslash, or `\\n`, `\\r`, `\\t`, \
         `\\xNN`, `\\u{{NNNN}}`",
        escape.chars().take(8).collect::<String>()
    )
}

/// A lock name given on the command line: its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Name(pub Vec<u8>);

impl AsRef<[u8]> for Name {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&escape(&self.0))
    }
}

/// `name` in the escaped form: never a control character, never ambiguous.
pub fn escape(name: &[u8]) -> String {
    let mut out = String::with_capacity(name.len());
    for chunk in name.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str(r"\\"),
                '\n' => out.push_str(r"\n"),
                '\r' => out.push_str(r"\r"),
                '\t' => out.push_str(r"\t"),
                c if c.is_ascii_control() => {
                    let _ = write!(out, "\\x{:02x}", u32::from(c));
                }
                c if c.is_control() => {
                    let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// A NAME argument: the escaped form back to the name's bytes (clap's value parser).
pub fn parse(arg: &str) -> Result<Name, String> {
    let bytes = walk(arg, |bytes, escape| {
        let (byte_or_char, used) = unescape(escape).ok_or_else(|| bad_escape(escape))?;
        bytes.extend_from_slice(&byte_or_char.bytes());
        Ok(used)
    })?;
    Ok(Name(bytes))
}

enum Unescaped {
    Byte(u8),
    Char(char),
}

impl Unescaped {
    /// The bytes it stands for.
    fn bytes(&self) -> Vec<u8> {
        match *self {
            Unescaped::Byte(b) => vec![b],
            Unescaped::Char(c) => c.encode_utf8(&mut [0; 4]).as_bytes().to_vec(),
        }
    }
}

/// The escape that `s` starts with (what follows a backslash), and its length.
fn unescape(s: &str) -> Option<(Unescaped, usize)> {
    let hex = |digits: &str| {
        digits
            .bytes()
            .all(|b| b.is_ascii_hexdigit())
            .then(|| u32::from_str_radix(digits, 16).ok())
            .flatten()
    };
    match s.as_bytes().first()? {
        b'\\' => Some((Unescaped::Byte(b'\\'), 1)),
        b'n' => Some((Unescaped::Byte(b'\n'), 1)),
        b'r' => Some((Unescaped::Byte(b'\r'), 1)),
        b't' => Some((Unescaped::Byte(b'\t'), 1)),
        b'x' => {
            let b = hex(s.get(1..3)?)?;
            Some((Unescaped::Byte(u8::try_from(b).ok()?), 3))
        }
        b'u' => {
            let (digits, _) = s.strip_prefix("u{")?.split_once('}')?;
            if !(1..=6).contains(&digits.len()) {
                return None;
            }
            let c = char::from_u32(hex(digits)?)?;
            Some((Unescaped::Char(c), digits.len() + 3))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{escape, parse, parse_pattern};

    #[test]
    fn every_name_comes_back_from_its_escaped_form() {
        let names: [&[u8]; 8] = [
            b"orders:42",
            b"\xffjob",
            b"\\xffjob",
            b"a\\b\\\\c",
            b"job\nadmin\x1b[2J\t\r\x7f",
            "caf\u{e9} \u{85} \u{1f512}".as_bytes(),
            b"\xe2\x82",
            b"",
        ];
        for name in names {
            let shown = escape(name);
            assert!(!shown.chars().any(char::is_control), "{shown}");
            assert_eq!(parse(&shown).unwrap().0, name, "{shown}");
        }
        assert_ne!(escape(b"\xffjob"), escape(b"\\xffjob"));
    }

    #[test]
    fn a_bad_escape_is_refused() {
        for arg in [
            r"a\",
            r"a\q",
            r"\x",
            r"\xf",
            r"\xgg",
            r"\x+f",
            r"\u{}",
            r"\u{d800}",
            r"\u{1234567}",
            r"\u1234",
        ] {
            assert!(parse(arg).is_err(), "{arg}");
        }
        assert_eq!(parse(r"\u{e9}\x41").unwrap().0, "\u{e9}A".as_bytes());
    }

    #[test]
    fn a_pattern_keeps_the_globs_escapes_and_makes_escaped_bytes_literal() {
        let cases: [(&str, &[u8]); 9] = [
            ("jobs:*", b"jobs:*"),
            (r"\xff*", b"\xff*"),
            (r"a\x2ab", br"a\*b"),
            (r"a\x5cb", br"a\\b"),
            (r"a\*b", br"a\*b"),
            (r"a\\xffb", br"a\\xffb"),
            (r"a\tb?", b"a\tb?"),
            (r"caf\u{e9}", "caf\u{e9}".as_bytes()),
            (r"end\", br"end\"),
        ];
        for (arg, glob) in cases {
            let pattern = parse_pattern(arg).unwrap();
            assert_eq!(pattern.glob, glob, "{arg}");
            assert_eq!(pattern.to_string(), arg);
        }
        for arg in [r"\x", r"\xzz", r"\u{}", r"\u1234"] {
            assert!(parse_pattern(arg).is_err(), "{arg}");
        }
    }
}
