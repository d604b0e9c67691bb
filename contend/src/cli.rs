//! The command line: every flag of the tool, including the hidden ones the parent passes
//! to its worker processes.

use std::path::PathBuf;

use clap::Parser;

use crate::strategy::Strategy;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "contend",
    about = "Measure redbaton's wakeup strategies under contention: P processes × T threads × S critical sections of H µs on K keys.",
    after_help = "--quick = -p 2 -t 4 -s 100 --hold-us 100 -k 1 and poll-100ms with S/5 sections; explicit flags override it.\n\
                  --matrix = 1×2, 1×8, 1×32 and 4×8 (processes × threads) with notify and notify+handoff, H=100µs, S=500 (--quick: S=60).\n\
                  --compare-cluster = -p 4 -t 4 -s 200 --hold-us 1000 -k 8 --strategies notify+handoff, against one node and then a cluster; explicit flags override it."
)]
pub struct Args {
    /// Redis to use; without it a throwaway redis-server is started.
    #[arg(long)]
    pub url: Option<String>,
    /// Lock in a Redis Cluster: start one on loopback (3 masters + 3 replicas) and build
    /// the clients with `.cluster([seed])`; the counters live on a separate redis-server.
    /// Not with --url.
    #[arg(long)]
    pub cluster: bool,
    /// Run the same configuration against one node and against a Redis Cluster, print
    /// both tables and their ratios (see below).
    #[arg(long, conflicts_with_all = ["cluster", "url", "matrix", "svg"])]
    pub compare_cluster: bool,
    /// With --compare-cluster: give the one node a replica, as every cluster master has
    /// one, so that both sides replicate their writes (and count the replicas' re-runs).
    #[arg(long, requires = "compare_cluster")]
    pub node_replica: bool,
    /// Worker processes [default: 4; --quick: 2].
    #[arg(short = 'p', long)]
    pub processes: Option<usize>,
    /// Threads per process [default: 8; --quick: 4].
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Critical sections per thread [default: 200; --quick: 100].
    #[arg(short = 's', long)]
    pub sections: Option<usize>,
    /// Critical sections per thread for poll-100ms [default: S; --quick: S/5].
    #[arg(long)]
    pub slow_sections: Option<usize>,
    /// How long each critical section holds the lock, in µs [default: 100].
    #[arg(long)]
    pub hold_us: Option<u64>,
    /// Hold the lock by busy-waiting H µs instead of sleeping: steadier timings (no timer
    /// slack, no wake-up from an idle CPU), at the cost of a busy core per holder.
    #[arg(long)]
    pub spin: bool,
    /// Number of lock keys; section i of thread g takes key (g + i) mod K [default: 1].
    #[arg(short = 'k', long)]
    pub keys: Option<usize>,
    /// Lock lease in ms [default: 10000].
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// Strategies to run, comma-separated [default: all four].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub strategies: Vec<Strategy>,
    /// Handoff budget of notify+handoff: consecutive local handoffs while another process
    /// waits [default: the library's].
    #[arg(long, value_name = "N")]
    pub max_handoffs: Option<u32>,
    /// Handoff budget of notify+handoff: how long one process may keep passing the lock
    /// on locally while another waits, in ms (fractions allowed) [default: the library's].
    #[arg(long, value_name = "MS")]
    pub slice_ms: Option<f64>,
    /// Run the matrix (see below) and print one combined table.
    #[arg(long)]
    pub matrix: bool,
    /// Small, fast settings (see below).
    #[arg(long)]
    pub quick: bool,
    /// Print machine-readable results (JSON) instead of the table; no progress bar.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG chart of throughput and commands per section.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Write every critical section as a CSV line (config, strategy, key, process, thread,
    /// section, end µs after go, wait µs, remote fence, local handoff number).
    #[arg(long, value_name = "FILE")]
    pub sections_csv: Option<PathBuf>,
    /// Abort when workers report no progress for this many seconds.
    #[arg(long, default_value_t = 120)]
    pub stall_s: u64,

    // Worker mode (the tool runs itself as its worker processes).
    #[arg(long, hide = true)]
    pub worker: bool,
    #[arg(long, hide = true, default_value_t = 0)]
    pub worker_id: usize,
    #[arg(long, hide = true, value_enum)]
    pub strategy: Option<Strategy>,
    #[arg(long, hide = true)]
    pub prefix: Option<String>,
    /// Where the counters live when not on `--url` (cluster mode, comparison).
    #[arg(long, hide = true)]
    pub counter_url: Option<String>,
}
