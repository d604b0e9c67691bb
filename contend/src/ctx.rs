//! What one run of the tool measures with: the Redis, the admin connection, the progress
//! bar and the `--sections-csv` output, shared by the ideal row and the strategies.

use std::time::Duration;

use indicatif::ProgressBar;

use crate::server::Lab;

pub struct Ctx {
    /// Where the locks and the counters live, and how commands are counted.
    pub lab: Lab,
    /// To the counters' server (the locks' too, unless they live apart).
    pub admin: redis::Connection,
    pub bar: ProgressBar,
    pub stall: Duration,
    /// `--sections-csv`: one line per critical section.
    pub csv: Option<std::io::BufWriter<std::fs::File>>,
    /// Put before the config in `--sections-csv` lines (`node:`, `cluster:` when comparing).
    pub csv_tag: &'static str,
}

impl Ctx {
    pub fn counter_url(&self) -> &str {
        self.lab.counter_url.as_deref().unwrap_or(&self.lab.url)
    }
}
