//! `cargo xtask cluster`: a real cluster on one machine.
//!
//! Network namespaces joined by a bridge, each node's uplink shaped with `tc`, and
//! OpenMPI over TCP between them (shared memory within a node). The namespaces, veths,
//! shaping and the `mpirun` launch live in `xtask/cluster.sh`; this module builds the
//! programs, drives the script, and checks and summarises what it measured:
//!
//! - `cluster run`: one `zeropp train --backend mpi` across the cluster, with the
//!   metrics and the kernel's interface counters in `--out`;
//! - `cluster probe`: node-to-node MPI bandwidth, achieved / configured;
//! - `test-cluster` (run by `cargo xtask ci`): losses bitwise equal to the thread
//!   backend, kernel bytes against the project's counters, the transport per pair;
//!   with `--faults`, the network fault tests;
//! - `bench cluster`: step-time speedups over ZeRO-3 per inter-node rate, against the
//!   link model's prediction for the same configuration.
//!
//! This file holds the shared launch machinery (`Shape`, `launch`, the builds) and the
//! `cluster` dispatch; each command lives in its own file (`run`, `probe`, `test` with
//! `faults`, `bench`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::Value;

use crate::cmd::{cargo, root, run as run_step};

mod bench;
mod checks;
mod faults;
mod plan_bench;
mod probe;
mod run;
mod test;
mod torch_bench;

pub(crate) use bench::bench;
pub(crate) use plan_bench::{
    cluster_part as bench_plan_cluster, memory_part as bench_plan_memory, torch_part as bench_plan_torch,
};
pub(crate) use test::test;
pub(crate) use torch_bench::bench as bench_torch;

const HELP: &str = "\
cargo xtask cluster <command>

commands:
  run --nodes N --local-size L --rate RATE --delay DELAY [--loss P] [--jitter J] [--queue T] [--out DIR]
      [--time-limit S] [--debug] -- ZEROPP_TRAIN_ARGS...
        builds zeropp (--features mpi), brings up N network namespaces with shaped uplinks
        (RATE: 100mbit, 1gbit, ..., or unshaped; DELAY: 5ms, 0; LOSS in percent; T: the
        tbf queue as time at the rate, 100ms by default, beyond which packets drop) and runs
        `zeropp train --backend mpi --local-size L ZEROPP_TRAIN_ARGS` across them under
        mpirun (TCP between nodes, shared memory within). Writes DIR/metrics.jsonl,
        DIR/netdev.json (each node's kernel counters before/after) and prints one summary.
  probe [--rates R1,R2,...]
        node-to-node bandwidth through MPI send/recv, achieved/configured (default 100mbit,1gbit)
  clean
        deletes namespaces left by runs whose process is gone (zpp-*)
Needs root, iproute2 and OpenMPI. `cargo xtask test-cluster` and `cargo xtask bench cluster`
use the same machinery.
";

/// The shape of one cluster: nodes, ranks per node and the uplinks.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    nodes: usize,
    local_size: usize,
    rate: String,
    delay: String,
    loss: Option<String>,
    jitter: Option<String>,
    /// The tbf queue as time at the rate (`cluster.sh --queue`; 100 ms when `None`).
    queue: Option<String>,
}

impl Shape {
    fn new(nodes: usize, local_size: usize, rate: &str) -> Self {
        Self {
            nodes,
            local_size,
            rate: rate.into(),
            delay: "0".into(),
            loss: None,
            jitter: None,
            queue: None,
        }
    }
    fn world(&self) -> usize {
        self.nodes * self.local_size
    }
}

/// Extra knobs of one launch.
#[derive(Default)]
struct Launch {
    time_limit_s: u64,
    /// `cluster.sh --launcher each-node`: the program once per node namespace (torchrun).
    each_node: bool,
    btl_verbose: bool,
    fault: Option<String>,
    env: Vec<(String, String)>,
}

/// What one launch left behind.
struct Outcome {
    success: bool,
    code: Option<i32>,
    wall_s: f64,
    log: String,
}

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("run") => run::run_cmd(&args[1..]),
        Some("probe") => probe::probe(&args[1..]),
        Some("clean") => clean(),
        Some("help") | Some("--help") | Some("-h") | None => {
            print!("{HELP}");
            Ok(())
        }
        Some(other) => Err(format!("cluster: unknown command `{other}`\n\n{HELP}")),
    }
}

fn script() -> PathBuf {
    root().join("xtask/cluster.sh")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// Builds `zeropp` with MPI support and returns the binary. The debug build is
/// the one xtask/mpi-tests.sh makes, with the same packages, features and
/// targets (so features unify alike and `ci` builds the stack once).
fn build_zeropp(release: bool, profile: &str) -> Result<PathBuf, String> {
    let mut c = cargo();
    if release {
        c.args(["build", "--locked", "--release", "-p", "zeropp", "--features", "mpi"]);
    } else {
        c = crate::cmd::mpi_suite_build(profile);
    }
    run_step("build zeropp (mpi)", c)?;
    Ok(target_dir().join(if release { "release" } else { "debug" }).join("zeropp"))
}

/// Runs `cluster.sh` with `shape` and `program args`; the output goes to `out/run.log`
/// (and is returned), or to the terminal when `echo` is set.
fn launch(
    shape: &Shape,
    out: &Path,
    opts: &Launch,
    program: &Path,
    args: &[String],
    echo: bool,
) -> Result<Outcome, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut c = Command::new("bash");
    c.arg(script())
        .args(["--nodes", &shape.nodes.to_string(), "--local-size", &shape.local_size.to_string()])
        .args(["--rate", &shape.rate, "--delay", &shape.delay])
        .arg("--out")
        .arg(out)
        .args(["--time-limit", &opts.time_limit_s.max(1).to_string()]);
    if let Some(l) = &shape.loss {
        c.args(["--loss", l]);
    }
    if let Some(j) = &shape.jitter {
        c.args(["--jitter", j]);
    }
    if let Some(q) = &shape.queue {
        c.args(["--queue", q]);
    }
    if opts.btl_verbose {
        c.arg("--mpi-verbose");
    }
    if let Some(f) = &opts.fault {
        c.args(["--fault", f]);
    }
    if opts.each_node {
        c.args(["--launcher", "each-node"]);
    }
    c.arg("--");
    if !opts.each_node {
        for (k, v) in &opts.env {
            c.args(["-x", &format!("{k}={v}")]);
        }
    }
    c.arg(program).args(args);
    for (k, v) in &opts.env {
        c.env(k, v);
    }
    let log_path = out.join("run.log");
    let start = Instant::now();
    let status = if echo {
        c.status()
    } else {
        let log = std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        c.stdout(Stdio::from(log)).stderr(Stdio::from(err)).status()
    }
    .map_err(|e| format!("cluster.sh: could not start: {e}"))?;
    let log = if echo { String::new() } else { std::fs::read_to_string(&log_path).unwrap_or_default() };
    Ok(Outcome { success: status.success(), code: status.code(), wall_s: start.elapsed().as_secs_f64(), log })
}

fn value<'a>(args: &'a [String], i: &mut usize, flag: &str) -> Result<&'a str, String> {
    *i += 1;
    args.get(*i).map(String::as_str).ok_or_else(|| format!("{flag} needs a value"))
}

/// The run's metrics: (per-step records, summary).
fn read_metrics(path: &Path) -> Result<(Vec<Value>, Value), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut steps = Vec::new();
    let mut summary = Value::Null;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(s) = v.get("summary") {
            summary = s.clone();
        } else if v.get("loss").is_some() {
            steps.push(v);
        }
    }
    Ok((steps, summary))
}

/// Bits per second of a rate as the script takes it (`100mbit`, `1gbit`, ...).
fn rate_bits(rate: &str) -> Option<f64> {
    let r = rate.to_ascii_lowercase();
    let end = r.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(r.len());
    let n: f64 = r[..end].parse().ok()?;
    let unit = r[end..].trim_end_matches("/s");
    let f = match unit {
        "bit" | "" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        _ => return None,
    };
    Some(n * f)
}

fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ---------------------------------------------------------------- clean

fn clean() -> Result<(), String> {
    let out = Command::new("ip").args(["netns", "list"]).output().map_err(|e| format!("ip: {e}"))?;
    let list = String::from_utf8_lossy(&out.stdout);
    let mut removed = 0;
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        // zpp-<pid hex + 2 random hex digits, last 6>-...: only namespaces with no process left.
        if !name.starts_with("zpp-") {
            continue;
        }
        let pids = Command::new("ip").args(["netns", "pids", name]).output().map_err(|e| e.to_string())?;
        if !String::from_utf8_lossy(&pids.stdout).trim().is_empty() {
            continue;
        }
        let del = Command::new("ip").args(["netns", "del", name]).status().map_err(|e| e.to_string())?;
        if del.success() {
            removed += 1;
        }
    }
    println!("cluster clean: removed {removed} idle zpp-* namespaces");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_tc_writes_them() {
        assert_eq!(rate_bits("100mbit"), Some(100e6));
        assert_eq!(rate_bits("1gbit"), Some(1e9));
        assert_eq!(rate_bits("1Gbit/s"), Some(1e9));
        assert_eq!(rate_bits("12.5kbit"), Some(12.5e3));
        assert_eq!(rate_bits("unshaped"), None);
        assert_eq!(rate_bits("10MB/s"), None, "bytes per second are not a tc rate here");
    }
}
