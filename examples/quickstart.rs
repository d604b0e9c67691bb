//! Quickstart: four threads share one counter in Redis under one lock.
//!
//! ```text
//! cargo run --example quickstart
//! ```
//!
//! Uses `REDIS_URL` when set; otherwise Redis on 127.0.0.1:6379 if one answers; otherwise it
//! starts a throwaway `redis-server` (no persistence, in a temp dir) and stops it at the end.

use std::time::Duration;

use clap::Parser;
use redbaton::LockClient;

/// Four threads add 1 to a counter in Redis 50 times each, under one lock: the counter
/// ends at 200 only if no two of them ever held the lock at once.
///
/// Redis: $REDIS_URL when set; else 127.0.0.1:6379 if one answers; else a throwaway
/// redis-server (temp dir, no persistence) started here and stopped at the end.
#[derive(Parser)]
struct Cli {}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();

    // REDIS_URL, else 127.0.0.1:6379 if it answers, else a throwaway server kept alive until
    // the end of main (or a message saying how to install one, and exit status 1).
    let (url, server) = redbaton_testkit::example_redis(true);
    match &server {
        Some(_) => println!(
            "no Redis on 127.0.0.1:6379 and no REDIS_URL: started a throwaway redis-server \
             at {url} (temp dir, no persistence), stopped when this program ends"
        ),
        None => println!(
            "using the Redis at {url}: it writes quickstart:counter (deleted at the end) and \
             the lock's keys under quickstart: (its fence counter expires in 7 days), and may \
             add the classes it needs to notify-keyspace-events"
        ),
    }

    let client = LockClient::builder()
        .node(url.as_str())
        .key_prefix("quickstart:")
        .lease(Duration::from_secs(10))
        .build()?;

    // A counter in Redis, read and written non-atomically: only the lock keeps it exact.
    let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
    redis::cmd("SET")
        .arg("quickstart:counter")
        .arg(0)
        .query::<()>(&mut conn)?;

    let threads: Vec<_> = (0..4)
        .map(|t| {
            let client = client.clone();
            let url = url.clone();
            std::thread::spawn(move || -> Result<u64, redbaton::Error> {
                let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
                let mut last_token = 0;
                for _ in 0..50 {
                    let guard = client.lock("counter")?;
                    assert!(guard.fencing_token() > last_token, "tokens grow");
                    last_token = guard.fencing_token();
                    let n: u64 = redis::cmd("GET")
                        .arg("quickstart:counter")
                        .query(&mut conn)?;
                    redis::cmd("SET")
                        .arg("quickstart:counter")
                        .arg(n + 1)
                        .query::<()>(&mut conn)?;
                    guard.unlock()?;
                }
                println!("thread {t} done, last fencing token {last_token}");
                Ok(last_token)
            })
        })
        .collect();
    for t in threads {
        t.join().expect("worker thread panicked")?;
    }

    let n: u64 = redis::cmd("GET")
        .arg("quickstart:counter")
        .query(&mut conn)?;
    let s = client.stats();
    println!("counter = {n} (expected 200)");
    println!(
        "remote acquisitions {}, local handoffs {}, redis commands {}, wakeups by event {}",
        s.remote_acquisitions, s.local_handoffs, s.commands, s.wakeups_event
    );
    redis::cmd("DEL")
        .arg("quickstart:counter")
        .query::<()>(&mut conn)?;
    if n != 200 {
        return Err("counter is off: mutual exclusion failed".into());
    }
    // Stop the client's threads before the server they talk to.
    client.shutdown(Duration::from_secs(10))?;
    if let Some(server) = server {
        drop(server);
        println!("stopped the throwaway redis-server");
    }
    Ok(())
}
