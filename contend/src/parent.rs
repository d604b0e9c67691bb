//! The parent process: resolves the configurations to run, runs them against its Redis and
//! reports.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::Res;
use crate::chart::draw_svg;
use crate::cli::Args;
use indicatif::ProgressBar;
use redbaton_testkit::server::RedisServer;

use crate::ctx::Ctx;
use crate::report::{
    CompareOutput, MatrixOutput, Output, compare_ratios, print_matrix, print_ratios, print_table,
    target_of,
};
use crate::results::ConfigResult;
use crate::run::{make_bar, run_config};
use crate::server::{Lab, raw_conn};
use crate::settings::{MATRIX, MATRIX_SECTIONS, MATRIX_SECTIONS_QUICK, Settings, config_label};
use crate::strategy::Strategy;

pub fn parent_main(args: &Args) -> Res<()> {
    let settings = Settings::from_args(args)?;
    if args.matrix
        && (args.processes.is_some() || args.threads.is_some() || !args.strategies.is_empty())
    {
        return Err("--matrix sets --processes, --threads and --strategies itself".into());
    }
    // The configurations to run, with their strategies.
    let runs: Vec<(Settings, Vec<Strategy>)> = if args.matrix {
        MATRIX
            .iter()
            .map(|&(p, t)| {
                let s = Settings {
                    processes: p,
                    threads: t,
                    sections: args.sections.unwrap_or(if args.quick {
                        MATRIX_SECTIONS_QUICK
                    } else {
                        MATRIX_SECTIONS
                    }),
                    hold_us: args.hold_us.unwrap_or(100),
                    ..settings.clone()
                };
                (s, vec![Strategy::Notify, Strategy::NotifyHandoff])
            })
            .collect()
    } else {
        let strategies = if args.strategies.is_empty() && args.compare_cluster {
            vec![Strategy::NotifyHandoff]
        } else if args.strategies.is_empty() && args.cluster {
            // The BLPOP queue needs one server for all its keys.
            Strategy::ALL
                .into_iter()
                .filter(|&st| st != Strategy::BlpopQueue)
                .collect()
        } else if args.strategies.is_empty() {
            Strategy::ALL.to_vec()
        } else {
            let mut v = args.strategies.clone();
            v.dedup();
            v
        };
        vec![(settings, strategies)]
    };
    if args.cluster && args.url.is_some() {
        return Err("--cluster starts its own cluster: not with --url".into());
    }
    let on_cluster = args.cluster || args.compare_cluster;
    if on_cluster
        && runs
            .iter()
            .any(|(_, st)| st.contains(&Strategy::BlpopQueue))
    {
        return Err("blpop-queue does not run on a cluster".into());
    }
    let total: u64 = runs
        .iter()
        .flat_map(|(s, strategies)| {
            strategies
                .iter()
                .map(|&st| (s.processes * s.threads * s.sections_for(st)) as u64)
        })
        .sum();
    let bar = make_bar(args.json, total * if args.compare_cluster { 2 } else { 1 })?;
    let csv = match &args.sections_csv {
        Some(path) => {
            let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
            writeln!(
                f,
                "config,strategy,key,process,thread,section,end_us,wait_us,fence,handoff"
            )?;
            Some(f)
        }
        None => None,
    };
    let stall = Duration::from_secs(args.stall_s.max(1));
    let run_id = format!("{}", std::process::id());
    if args.compare_cluster {
        return compare(args, &runs, bar, csv, stall, &run_id);
    }
    // Keep the throwaway servers alive until the end: the counters' (cluster mode) and
    // the lab's own.
    let counters = args.cluster.then(redbaton_testkit::start_or_exit);
    let lab = match &counters {
        Some(c) => Lab::cluster(&c.url())?,
        None => Lab::shared(args.url.as_deref()),
    };
    let mut ctx = Ctx {
        admin: raw_conn(&counters.as_ref().map_or(lab.url.clone(), RedisServer::url))?,
        lab,
        bar,
        stall,
        csv,
        csv_tag: "",
    };
    let url = ctx.lab.url.clone();
    let desc = ctx.lab.desc.clone();
    let started = Instant::now();
    let configs = run_all(&mut ctx, args, &runs, &run_id)?;
    let elapsed = started.elapsed();
    ctx.bar.finish_and_clear();

    if args.matrix {
        let target = target_of(&configs);
        if args.json {
            let out = MatrixOutput {
                redis_url: &url,
                matrix: true,
                elapsed_s: elapsed.as_secs_f64(),
                configs: &configs,
                target,
            };
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print_matrix(&desc, &configs, elapsed, target.as_ref());
        }
    } else if args.json {
        let out = Output {
            redis_url: &url,
            config: &configs[0],
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&desc, &configs[0]);
    }
    if let Some(path) = &args.svg {
        let s = &configs[0].settings;
        let keys = format!("K={} key{}", s.keys, if s.keys == 1 { "" } else { "s" });
        let title = if args.matrix {
            format!(
                "redbaton contend --matrix: S={} sections per thread, H={} hold, {keys}; {}",
                s.sections,
                s.hold_desc(),
                s.budget()
            )
        } else {
            format!(
                "redbaton contend: P={} processes × T={} threads × S={} sections (poll-100ms: {}), H={} hold, {keys}",
                s.processes,
                s.threads,
                s.sections,
                s.slow_sections,
                s.hold_desc(),
            )
        };
        draw_svg(path, &title, &configs)?;
        if !args.json {
            println!("\nchart written to {}", path.display());
        }
    }
    check_exact(&configs)
}

fn check_exact(configs: &[ConfigResult]) -> Res<()> {
    let exact = configs
        .iter()
        .all(|c| c.ideal.counter.exact && c.results.iter().all(|r| r.counter.exact));
    if !exact {
        return Err("a counter is off: mutual exclusion failed".into());
    }
    Ok(())
}

/// Every configuration of `runs` against `ctx`'s lab.
fn run_all(
    ctx: &mut Ctx,
    args: &Args,
    runs: &[(Settings, Vec<Strategy>)],
    run_id: &str,
) -> Res<Vec<ConfigResult>> {
    let mut configs = Vec::new();
    for (s, strategies) in runs {
        let label = if args.matrix {
            format!("{} ", config_label(s))
        } else {
            String::new()
        };
        configs.push(run_config(ctx, s, strategies, &label, run_id)?);
    }
    Ok(configs)
}

/// `--compare-cluster`: the configuration against one node, then against a cluster, with
/// the counters on a server of their own for both; both tables and their ratios.
fn compare(
    args: &Args,
    runs: &[(Settings, Vec<Strategy>)],
    bar: ProgressBar,
    csv: Option<std::io::BufWriter<std::fs::File>>,
    stall: Duration,
    run_id: &str,
) -> Res<()> {
    let counters = redbaton_testkit::start_or_exit();
    let counter_url = counters.url();
    let mut ctx = Ctx {
        lab: Lab::lone_node(&counter_url, args.node_replica)?,
        admin: raw_conn(&counter_url)?,
        bar: bar.clone(),
        stall,
        csv,
        csv_tag: "node:",
    };
    let node = run_all(&mut ctx, args, runs, &format!("{run_id}n"))?;
    let (node_url, node_desc) = (ctx.lab.url.clone(), ctx.lab.desc.clone());
    let csv = ctx.csv.take();
    // Stop the node before the cluster starts.
    drop(ctx);
    let mut ctx = Ctx {
        lab: Lab::cluster(&counter_url)?,
        admin: raw_conn(&counter_url)?,
        bar: bar.clone(),
        stall,
        csv,
        csv_tag: "cluster:",
    };
    let cluster = run_all(&mut ctx, args, runs, &format!("{run_id}c"))?;
    if let Some(csv) = &mut ctx.csv {
        csv.flush()?;
    }
    bar.finish_and_clear();
    let ratios = compare_ratios(&node[0], &cluster[0]);
    if args.json {
        let out = CompareOutput {
            node: Output {
                redis_url: &node_url,
                config: &node[0],
            },
            cluster: Output {
                redis_url: &ctx.lab.url,
                config: &cluster[0],
            },
            ratios: &ratios,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&node_desc, &node[0]);
        println!();
        print_table(&ctx.lab.desc, &cluster[0]);
        println!();
        print_ratios(&ratios);
    }
    check_exact(&node)?;
    check_exact(&cluster)
}
