//! The parent process: resolves the configurations to run, runs them against its Redis and
//! reports.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::Res;
use crate::chart::draw_svg;
use crate::cli::Args;
use crate::report::{MatrixOutput, Output, print_matrix, print_table, target_of};
use crate::run::{Ctx, make_bar, run_config};
use crate::server::{raw_conn, redis_for};
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
        let strategies = if args.strategies.is_empty() {
            Strategy::ALL.to_vec()
        } else {
            let mut v = args.strategies.clone();
            v.dedup();
            v
        };
        vec![(settings, strategies)]
    };
    // Keep a throwaway server alive until the end.
    let (url, _server) = redis_for(args.url.as_deref());
    let total: u64 = runs
        .iter()
        .flat_map(|(s, strategies)| {
            strategies
                .iter()
                .map(|&st| (s.processes * s.threads * s.sections_for(st)) as u64)
        })
        .sum();
    let mut ctx = Ctx {
        url: &url,
        admin: raw_conn(&url)?,
        bar: make_bar(args.json, total)?,
        stall: Duration::from_secs(args.stall_s.max(1)),
        csv: match &args.sections_csv {
            Some(path) => {
                let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
                writeln!(
                    f,
                    "config,strategy,key,process,thread,section,end_us,wait_us,fence,handoff"
                )?;
                Some(f)
            }
            None => None,
        },
    };
    let run_id = format!("{}", std::process::id());
    let started = Instant::now();
    let mut configs = Vec::new();
    for (s, strategies) in &runs {
        let label = if args.matrix {
            format!("{} ", config_label(s))
        } else {
            String::new()
        };
        configs.push(run_config(&mut ctx, s, strategies, &label, &run_id)?);
    }
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
            print_matrix(&url, &configs, elapsed, target.as_ref());
        }
    } else if args.json {
        let out = Output {
            redis_url: &url,
            config: &configs[0],
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&url, &configs[0]);
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
    let exact = configs
        .iter()
        .all(|c| c.ideal.counter.exact && c.results.iter().all(|r| r.counter.exact));
    if !exact {
        return Err("a counter is off: mutual exclusion failed".into());
    }
    Ok(())
}
