//! Critical sections as contenders saw them, and the check that matters after a fault:
//! two sections of one name that overlapped in time, where neither holder was told.

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
