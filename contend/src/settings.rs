//! The resolved run parameters: defaults, `--quick`, the matrix's configurations, and
//! checks of the flags.

use std::time::Duration;

use serde::Serialize;

use crate::Res;
use crate::cli::Args;
use crate::strategy::Strategy;

/// The resolved run parameters.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub processes: usize,
    pub threads: usize,
    pub sections: usize,
    pub slow_sections: usize,
    pub hold_us: u64,
    pub keys: usize,
    pub lease_ms: u64,
    /// Hold by busy-waiting instead of sleeping.
    pub spin: bool,
    /// notify+handoff's budget; `None` = the library's default.
    pub max_handoffs: Option<u32>,
    pub slice_ms: Option<f64>,
}

impl Settings {
    pub fn from_args(a: &Args) -> Res<Settings> {
        let (p, t, s, h, k) = if a.compare_cluster {
            // Two processes contend for each of 8 keys (threads g and g + 8 share a key,
            // in processes w and w + 2), and the 8 keys spread over the 3 masters.
            (4, 4, 200, 1000, 8)
        } else if a.quick {
            (2, 4, 100, 100, 1)
        } else {
            (4, 8, 200, 100, 1)
        };
        let sections = a.sections.unwrap_or(s);
        let slow_default = if a.quick {
            (sections / 5).max(1)
        } else {
            sections
        };
        let s = Settings {
            processes: a.processes.unwrap_or(p),
            threads: a.threads.unwrap_or(t),
            sections,
            slow_sections: a.slow_sections.unwrap_or(slow_default),
            hold_us: a.hold_us.unwrap_or(h),
            spin: a.spin,
            keys: a.keys.unwrap_or(k),
            lease_ms: a.lease_ms.unwrap_or(10_000),
            max_handoffs: a.max_handoffs,
            slice_ms: a.slice_ms,
        };
        if s.processes == 0 || s.threads == 0 || s.keys == 0 || s.sections == 0 {
            return Err("--processes, --threads, --sections and --keys must be at least 1".into());
        }
        if s.max_handoffs == Some(0) {
            return Err("--max-handoffs must be at least 1".into());
        }
        if let Some(ms) = s.slice_ms
            && !(ms.is_finite() && ms > 0.0 && ms < 1e9)
        {
            return Err(format!("--slice-ms {ms}: must be a positive number of ms").into());
        }
        Ok(s)
    }

    pub fn hold_desc(&self) -> String {
        let how = if self.spin { "busy-wait" } else { "sleep" };
        format!("{}µs ({how})", self.hold_us)
    }

    pub fn slice(&self) -> Option<Duration> {
        self.slice_ms.map(|ms| Duration::from_secs_f64(ms / 1e3))
    }

    /// Every section of every thread (poll-100ms may run fewer).
    pub fn total_sections(&self) -> usize {
        self.processes * self.threads * self.sections
    }

    /// The handoff budget notify+handoff runs with, for headers: explicit values, or the
    /// library's defaults (read from the builder's `Debug`, so they stay true if they change).
    pub fn budget(&self) -> String {
        let defaults = format!("{:?}", redbaton::Builder::default());
        let field = |name: &str| -> String {
            defaults
                .split_once(&format!("{name}: "))
                .map(|(_, rest)| rest.split([',', ' ', '}']).next().unwrap_or("?").to_owned())
                .unwrap_or_else(|| "?".to_owned())
        };
        let n = match self.max_handoffs {
            Some(n) => n.to_string(),
            None => format!("{} (library default)", field("max_handoffs")),
        };
        let slice = match self.slice_ms {
            Some(ms) => format!("{ms}ms"),
            None => format!("{} (library default)", field("handoff_slice")),
        };
        format!("max_handoffs {n}, handoff_slice {slice}")
    }

    pub fn sections_for(&self, strategy: Strategy) -> usize {
        match strategy {
            Strategy::Poll100ms => self.slow_sections,
            _ => self.sections,
        }
    }
}

/// The matrix's configurations: (processes, threads).
pub const MATRIX: [(usize, usize); 4] = [(1, 2), (1, 8), (1, 32), (4, 8)];

/// Sections per thread in the matrix (about a minute on 2 cores), and with `--quick`.
pub const MATRIX_SECTIONS: usize = 500;

pub const MATRIX_SECTIONS_QUICK: usize = 60;

pub fn config_label(s: &Settings) -> String {
    format!("{}×{}", s.processes, s.threads)
}
