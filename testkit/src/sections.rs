//! Critical sections as contenders saw them, and the check that matters after a fault:
//! two sections of one name that overlapped in time, where neither holder was told.
//!
//! A child's threads note each section as a [`Section`] and print them as one field
//! ([`Section::join`]); the parent reads them back with [`Section::parse_list`] and asks
//! [`Section::unexplained`] for the overlaps nobody was told of.
//!
//! ```
//! use redbaton_testkit::sections::Section;
//!
//! let s = |start, end, told| Section { name: "n".into(), start, end, token: 1, told };
//! let printed = Section::join(&[s(0, 10, false), s(5, 15, true)]);
//! let back = Section::parse_list(&printed);
//! assert_eq!(back, [s(0, 10, false), s(5, 15, true)]);
//! assert!(Section::unexplained(&back).is_empty(), "the second holder was told");
//! ```

/// One critical section as its holder saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// The lock's name.
    pub name: String,
    /// When the holder's work began and ended, in CLOCK_MONOTONIC nanoseconds.
    pub start: u64,
    pub end: u64,
    /// The fencing token of the hold.
    pub token: u64,
    /// The holder was told it did not hold the lock (lost signal, `check()` error, or an
    /// unlock that found the key gone or someone else's).
    pub told: bool,
}

impl Section {
    /// `sections` as one `RESULT` value: `name:start:end:token:told` joined by commas
    /// (names must not hold `:`, `,` or whitespace).
    pub fn join(sections: &[Section]) -> String {
        let one = |s: &Section| {
            let told = u8::from(s.told);
            format!("{}:{}:{}:{}:{told}", s.name, s.start, s.end, s.token)
        };
        sections.iter().map(one).collect::<Vec<_>>().join(",")
    }

    /// The sections of a value made by [`Section::join`]. Panics on a malformed one.
    pub fn parse_list(list: &str) -> Vec<Section> {
        list.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                let f: Vec<&str> = s.split(':').collect();
                assert_eq!(f.len(), 5, "a section is name:start:end:token:told: {s:?}");
                Section {
                    name: f[0].to_owned(),
                    start: f[1].parse().expect("start"),
                    end: f[2].parse().expect("end"),
                    token: f[3].parse().expect("token"),
                    told: f[4] == "1",
                }
            })
            .collect()
    }

    /// Per name: pairs of `sections` that overlapped in time where neither holder was
    /// told ([`unexplained_overlaps`]).
    pub fn unexplained(sections: &[Section]) -> Vec<(Section, Section)> {
        unexplained_overlaps(sections, |s| (&s.name, s.start, s.end, s.told))
    }
}

/// Pairs of `sections` (each: its name, start and end on a clock common to the processes,
/// and whether its holder was told it did not hold the lock) that overlapped in time on
/// the same name while neither holder was told.
///
/// ```
/// use redbaton_testkit::sections::unexplained_overlaps;
///
/// let s = [("a", 0, 10, false), ("a", 5, 15, false), ("b", 5, 15, false), ("a", 12, 20, true)];
/// let bad = unexplained_overlaps(&s, |x| (x.0, x.1, x.2, x.3));
/// assert_eq!(bad, vec![(s[0], s[1])]);
/// ```
pub fn unexplained_overlaps<'a, T: Clone>(
    sections: &'a [T],
    span: impl Fn(&'a T) -> (&'a str, u64, u64, bool),
) -> Vec<(T, T)> {
    let mut sorted: Vec<&T> = sections.iter().collect();
    sorted.sort_by_key(|s| {
        let (name, start, ..) = span(s);
        (name, start)
    });
    let mut bad = Vec::new();
    for (i, a) in sorted.iter().enumerate() {
        let (name, _, end, told_a) = span(a);
        for b in &sorted[i + 1..] {
            let (other, start, _, told_b) = span(b);
            if other != name || start >= end {
                break;
            }
            if !told_a && !told_b {
                bad.push(((*a).clone(), (*b).clone()));
            }
        }
    }
    bad
}
