//! Whether the head of a key's local queue should spin for a due baton: learned per key,
//! from the key's own handoffs.
//!
//! A spinning head saves the next holder's wake-up, but keeps a core busy while the
//! current holder still works; which of the two weighs more depends on the machine (how
//! much a wake-up costs there, and whether the holder's own round trips need the core the
//! head spins on). `docs/benchmarks.md` has the measurements behind this choice.
//!
//! So each key measures both. The table notes every local hold that began and ended with
//! a handoff: from the grant to the next grant, it includes the holder's wake-up and the
//! holder's work, the two things spinning trades against each other. Holds are taken in
//! blocks of [`BLOCK`] under one choice (a spin decided at one grant shows up in that hold
//! and in the wake-up of the next, so single holds cannot be compared), and a block counts
//! by its median. Each choice keeps an average of its blocks' medians; the next block takes
//! the cheaper choice, except that every [`EXPLORE_EVERY`]-th block tries the other, so
//! that a change of load is noticed. A key starts by spinning; a key whose contention ends
//! and starts again starts again.

use std::time::Duration;

/// Holds per measured block.
const BLOCK: usize = 16;
/// One block in this many tries the choice that currently looks worse.
const EXPLORE_EVERY: u32 = 8;

pub(crate) struct SpinChoice {
    /// Whether heads spin during the current block.
    spin: bool,
    /// The current block's holds so far.
    holds: [Duration; BLOCK],
    held: usize,
    blocks: u32,
    /// Average block median without and with spinning (indexed by `spin as usize`).
    mean: [Option<Duration>; 2],
}

impl SpinChoice {
    pub fn new() -> Self {
        SpinChoice {
            spin: true,
            holds: [Duration::ZERO; BLOCK],
            held: 0,
            blocks: 0,
            mean: [None, None],
        }
    }

    /// Whether the head of the queue should be told to spin now.
    pub fn spin(&self) -> bool {
        self.spin
    }

    /// A local hold that began and ended with a handoff, made under the current choice.
    pub fn note(&mut self, hold: Duration) {
        self.holds[self.held] = hold;
        self.held += 1;
        if self.held < BLOCK {
            return;
        }
        // The median, not the mean: on a virtual machine one hold in a block can take
        // milliseconds (the vCPU was descheduled), which would outweigh the difference
        // being measured.
        self.holds.sort_unstable();
        let block = self.holds[BLOCK / 2];
        let mean = &mut self.mean[usize::from(self.spin)];
        *mean = Some(mean.map_or(block, |m| (m * 3 + block) / 4));
        self.held = 0;
        self.blocks = self.blocks.wrapping_add(1);
        self.spin = match self.mean {
            // Try each once; then the cheaper, spinning only when it is cheaper.
            [_, None] => true,
            [None, _] => false,
            [Some(without), Some(with)] => {
                let best = with < without;
                if self.blocks.is_multiple_of(EXPLORE_EVERY) {
                    !best
                } else {
                    best
                }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// Runs `blocks` blocks, each hold lasting what the current choice costs; returns how
    /// many blocks spun.
    fn run(c: &mut SpinChoice, blocks: u32, with: Duration, without: Duration) -> u32 {
        let mut spun = 0;
        for _ in 0..blocks {
            spun += u32::from(c.spin());
            for _ in 0..BLOCK {
                c.note(if c.spin() { with } else { without });
            }
        }
        spun
    }

    #[test]
    fn smoke() {
        let mut c = SpinChoice::new();
        assert!(c.spin(), "a key starts by spinning");
        run(&mut c, 1, us(250), us(300));
        assert!(!c.spin(), "then tries not spinning once");
    }

    #[test]
    fn keeps_spinning_where_it_pays() {
        let mut c = SpinChoice::new();
        let spun = run(&mut c, 80, us(250), us(300));
        // All but the trial without (block 2) and the exploring blocks (9, 17, …, 73).
        assert_eq!(spun, 80 - 1 - 9);
    }

    #[test]
    fn stops_spinning_where_it_costs() {
        let mut c = SpinChoice::new();
        let spun = run(&mut c, 80, us(300), us(260));
        // The trial with (block 1), then only the exploring blocks (9, 17, …, 73).
        assert_eq!(spun, 1 + 9);
    }

    #[test]
    fn follows_a_change_of_machine_load() {
        let mut c = SpinChoice::new();
        run(&mut c, 40, us(300), us(260));
        assert!(run(&mut c, 8, us(300), us(260)) <= 1);
        // Now spinning pays: exploring blocks notice it, and the average follows.
        run(&mut c, 40, us(200), us(260));
        assert!(run(&mut c, 8, us(200), us(260)) >= 7);
    }

    #[test]
    fn one_slow_hold_does_not_decide() {
        let mut c = SpinChoice::new();
        // 17 blocks: the next one neither tries nor explores.
        run(&mut c, 17, us(250), us(300));
        assert!(c.spin());
        // A descheduled vCPU: one spinning hold in a block takes 5 ms.
        for i in 0..BLOCK {
            c.note(if i == 3 { us(5_000) } else { us(250) });
        }
        assert!(c.spin(), "the block's median is still 250 µs");
    }

    #[test]
    fn a_tie_does_not_spin() {
        let mut c = SpinChoice::new();
        let spun = run(&mut c, 40, us(250), us(250));
        assert!(spun <= 1 + 40 / EXPLORE_EVERY, "spun {spun} blocks");
    }
}
