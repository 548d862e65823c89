//! `zeropp train --backend mpi`: one process per rank under `mpirun`.
//!
//! The world is the MPI world (`--world`, when given, must match it); the node size
//! is `--local-size` when given, else `ZEROPP_LOCAL_SIZE`, else the ranks sharing
//! memory. Only rank 0 prints and writes `--metrics`. Any error on any rank ends the
//! whole job through `MPI_Abort`, with a message naming the rank and the cause.
//! Without the `mpi` feature, `--backend mpi` is a one-line error.

#[cfg(any(feature = "mpi", test))]
use zeropp_engine::train::Faults;

use crate::CliError;
use crate::config::TrainArgs;

/// Environment variable read by [`faults_from_env`] (a test hook of the MPI
/// tests): `fail:RANK:STEP` makes that rank fail in the middle of that step,
/// `nan:RANK:STEP` makes its gradient NaN.
#[cfg(any(feature = "mpi", test))]
pub(crate) const FAULT_ENV: &str = "ZEROPP_FAULT";

/// Parses [`FAULT_ENV`] (unset or empty means no fault).
#[cfg(feature = "mpi")]
fn faults_from_env() -> Result<Faults, CliError> {
    match std::env::var(FAULT_ENV) {
        Ok(v) if !v.trim().is_empty() => parse_faults(&v),
        _ => Ok(Faults::default()),
    }
}

/// Parses a fault spec: `fail:RANK:STEP` or `nan:RANK:STEP`.
#[cfg(any(feature = "mpi", test))]
fn parse_faults(spec: &str) -> Result<Faults, CliError> {
    let bad = || format!("{FAULT_ENV}=`{spec}`: expected fail:RANK:STEP or nan:RANK:STEP");
    let parts: Vec<&str> = spec.trim().split(':').collect();
    let [kind, rank, step] = parts.as_slice() else { return Err(bad().into()) };
    let at = (rank.parse::<usize>().map_err(|_| bad())?, step.parse::<usize>().map_err(|_| bad())?);
    match *kind {
        "fail" => Ok(Faults { fail: Some(at), ..Faults::default() }),
        "nan" => Ok(Faults { nan_gradient: Some(at), ..Faults::default() }),
        _ => Err(bad().into()),
    }
}

/// The error of `--backend mpi` in a build without the `mpi` feature.
#[cfg(not(feature = "mpi"))]
pub(crate) fn run(_args: &TrainArgs) -> Result<(), CliError> {
    Err("built without MPI support; rebuild with --features mpi".into())
}

/// Runs `zeropp train --backend mpi` on this process's rank (never returns an
/// error: failures abort the MPI job).
#[cfg(feature = "mpi")]
pub(crate) fn run(args: &TrainArgs) -> Result<(), CliError> {
    use zeropp_engine::train_mpi::or_abort;
    or_abort(|| run_rank(args));
    Ok(())
}

/// True when `--NAME` appears on the command line (clap's defaults cannot tell).
#[cfg(feature = "mpi")]
fn flag_given(name: &str) -> bool {
    let eq = format!("{name}=");
    std::env::args_os().skip(1).any(|a| a.to_str().is_some_and(|a| a == name || a.starts_with(&eq)))
}

#[cfg(feature = "mpi")]
fn run_rank(args: &TrainArgs) -> Result<(), CliError> {
    use zeropp_comm::Communicator as _;
    use zeropp_engine::train_mpi::{MpiComm, MpiOptions, train_model_mpi, train_mpi};

    use crate::config::train_config;
    use crate::print::{
        print_data, print_memory, print_plan, print_report, print_warnings, progress_bar, show_step,
    };

    let mut options = MpiOptions::default();
    if flag_given("--local-size") {
        options.local_size = Some(args.run.local_size);
    }
    let mut comm = MpiComm::init(options)?;
    let topo = *comm.topology();
    let rank = comm.rank();
    if flag_given("--world") && args.run.world != topo.world() {
        return Err(format!(
            "--world {} does not match the MPI world of {} processes (mpirun -np)",
            args.run.world,
            topo.world()
        )
        .into());
    }
    // The cluster is the MPI job's: rebuild the flags with its world and node size
    // (so hpZ defaults to the real node size), then as `train::run` does.
    let mut a = args.clone();
    a.run.world = topo.world();
    a.run.local_size = topo.local_size();
    let (mut cfg, warnings) = train_config(&a)?;
    cfg.faults = faults_from_env()?;
    cfg.engine.validate(cfg.world, cfg.local_size)?;
    let lead = rank == 0;
    if lead {
        print_warnings(&warnings);
        print_data(&cfg.data)?;
        print_plan(&a.run.model, &cfg, topo.nodes(), Some(&comm.thread_level()));
    }
    let llama = match crate::llama::parse(&a.run.model)? {
        Some(shape) => {
            let (data, _) = zeropp_engine::train::load_data(&cfg.data)?;
            Some((shape.build(data.vocab_size())?, data))
        }
        None => None,
    };
    let pb = lead.then(|| progress_bar(cfg.steps, "train"));
    let watchdog = lead.then(|| Watchdog::start(args.run.timeout_s.max(1)));
    let mut on_step = |r: &zeropp_engine::metrics::StepRecord| {
        if let Some(w) = &watchdog {
            w.progress();
        }
        if let Some(pb) = &pb {
            show_step(pb, r);
        }
    };
    let report = match &llama {
        Some((model, data)) => train_model_mpi(&mut comm, model, data, &cfg, &mut on_step),
        None => train_mpi(&mut comm, &cfg, &mut on_step),
    };
    if let Some(w) = &watchdog {
        w.stop();
    }
    if let Some(pb) = &pb {
        pb.finish();
    }
    let report = report?;
    if let Some(report) = report {
        print_report(&report.summary, cfg.metrics.as_deref());
    }
    // Every rank is a process: each reports its own peak.
    print_memory(&cfg, llama.as_ref().map(|(m, _)| m), 1, Some(rank));
    drop(comm);
    Ok(())
}

/// Rank 0's watchdog: MPI itself has no timeout, so a peer or link that went silent
/// (a node's network down) would block the job forever. When no step completes within
/// `--timeout` seconds, it ends the job through `MPI_Abort` with a message that says so.
#[cfg(feature = "mpi")]
struct Watchdog {
    last: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

#[cfg(feature = "mpi")]
impl Watchdog {
    fn start(timeout_s: u64) -> Self {
        use std::time::{Duration, Instant};
        let last = std::sync::Arc::new(std::sync::Mutex::new(Some(Instant::now())));
        let seen = std::sync::Arc::clone(&last);
        std::thread::spawn(move || {
            let limit = Duration::from_secs(timeout_s);
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let since = match *seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
                    Some(t) => t.elapsed(),
                    None => return,
                };
                if since > limit {
                    zeropp_comm::mpi::abort(
                        3,
                        &format!(
                            "no training step completed for {timeout_s} s (--timeout): \
                             a peer rank or the network between the nodes is gone"
                        ),
                    );
                }
            }
        });
        Self { last }
    }

    fn set(&self, v: Option<std::time::Instant>) {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = v;
    }

    fn progress(&self) {
        self.set(Some(std::time::Instant::now()));
    }

    fn stop(&self) {
        self.set(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse() -> Result<(), CliError> {
        assert_eq!(parse_faults("fail:3:2")?.fail, Some((3, 2)));
        assert_eq!(parse_faults("nan:0:1")?.nan_gradient, Some((0, 1)));
        assert!(parse_faults("boom:1:1").is_err());
        assert!(parse_faults("fail:1").is_err());
        assert!(parse_faults("fail:x:1").is_err());
        Ok(())
    }
}
