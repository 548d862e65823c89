//! `cargo xtask cluster probe`: node-to-node bandwidth through MPI send/recv
//! (the `mpi_bandwidth` example), achieved / configured per shaped rate.

use std::path::{Path, PathBuf};

use crate::cmd::{cargo, run as run_step};

use super::{Launch, Shape, launch, rate_bits, tail, target_dir, value};

fn build_bandwidth_example() -> Result<PathBuf, String> {
    let mut c = cargo();
    c.args(["build", "--locked", "--release", "-p", "zeropp-comm", "--features", "mpi"]);
    c.args(["--example", "mpi_bandwidth"]);
    run_step("build mpi_bandwidth", c)?;
    Ok(target_dir().join("release/examples/mpi_bandwidth"))
}

/// Achieved node-to-node bandwidth (bytes/s) through MPI at `rate`.
fn measure_bandwidth(bin: &Path, rate: &str, out: &Path, bidi: bool) -> Result<f64, String> {
    let bits = rate_bits(rate).ok_or_else(|| format!("probe: cannot read the rate `{rate}`"))?;
    // About 3 s of traffic at the configured rate.
    let total = (bits / 8.0 * 3.0).max(8.0 * 1024.0 * 1024.0);
    // 1 MiB messages: below the cluster's eager limit (4 MiB), as in training.
    let msg = 1usize << 20;
    let reps = ((total / msg as f64).ceil() as usize).max(2);
    let shape = Shape::new(2, 1, rate);
    let mut args = vec![msg.to_string(), reps.to_string()];
    if bidi {
        args.push("bidi".into());
    }
    let o = launch(&shape, out, &Launch { time_limit_s: 120, ..Launch::default() }, bin, &args, false)?;
    if !o.success {
        return Err(format!("probe at {rate} failed:\n{}", tail(&o.log, 20)));
    }
    o.log
        .split("bandwidth_bytes_per_s=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("probe at {rate}: no bandwidth in the output:\n{}", tail(&o.log, 20)))
}

pub(super) fn probe(args: &[String]) -> Result<(), String> {
    let mut rates = vec!["100mbit".to_string(), "1gbit".to_string()];
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--rates" => rates = value(args, &mut i, "--rates")?.split(',').map(String::from).collect(),
            other => return Err(format!("cluster probe: unknown option `{other}`")),
        }
        i += 1;
    }
    let bin = build_bandwidth_example()?;
    let mut worst: f64 = f64::INFINITY;
    for rate in &rates {
        let out = target_dir().join("cluster/probe").join(rate);
        let configured = rate_bits(rate).unwrap_or(f64::NAN) / 8.0;
        for (what, bidi) in [("one way", false), ("both ways at once, per direction", true)] {
            let achieved = measure_bandwidth(&bin, rate, &out, bidi)?;
            let ratio = achieved / configured;
            worst = worst.min(ratio);
            println!(
                "probe {rate}, {what}: achieved {:.2} MB/s of configured {:.2} MB/s: achieved/configured {ratio:.3}",
                achieved / 1e6,
                configured / 1e6
            );
        }
    }
    if worst >= 0.9 {
        println!("probe: every rate reaches >= 0.9 of its configuration");
    } else {
        println!("probe: worst achieved/configured {worst:.3} (< 0.9, the goal)");
    }
    Ok(())
}
