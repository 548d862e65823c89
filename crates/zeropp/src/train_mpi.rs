//! `zeropp train --backend mpi`: one process per rank under `mpirun`.
//!
//! The world is the MPI world (`--world`, when given, must match it); the node size
//! is `--local-size` when given, else `ZEROPP_LOCAL_SIZE`, else the ranks sharing
//! memory. Only rank 0 prints and writes `--metrics`. Any error on any rank ends the
//! whole job through `MPI_Abort`, with a message naming the rank and the cause.
//! Without the `mpi` feature, `--backend mpi` is a one-line error.

use crate::CliError;
use crate::train::TrainArgs;

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
    use zeropp_engine::metrics::format_summary;
    use zeropp_engine::train::load_data;
    use zeropp_engine::train_mpi::{Communicator as _, MpiComm, MpiOptions, faults_from_env, train_mpi};

    use crate::train::{progress_bar, show_step, train_config};

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
        for w in &warnings {
            eprintln!("warning: DeepSpeed config: {w}");
        }
        let (_, info) = load_data(&cfg.data)?;
        println!("data: {} (vocab {}, {} training tokens)", info.description, info.vocab, info.train_tokens);
        if let Some(h) = info.entropy_rate {
            println!("entropy rate of the source (the loss floor): {h:.4} nats/char");
        }
        println!(
            "training {:?} with {} on {} MPI ranks = {} nodes x {} ({} steps, global batch {}, MPI {})",
            a.run.model,
            cfg.engine.zero.label(),
            cfg.world,
            topo.nodes(),
            cfg.local_size,
            cfg.steps,
            cfg.engine.global_batch,
            comm.thread_level()
        );
    }
    let pb = lead.then(|| progress_bar(cfg.steps, "train"));
    let report = train_mpi(&mut comm, &cfg, &mut |r| {
        if let Some(pb) = &pb {
            show_step(pb, r);
        }
    });
    if let Some(pb) = &pb {
        pb.finish();
    }
    let report = report?;
    if let Some(report) = report {
        println!();
        print!("{}", format_summary(&report.summary));
        if let Some(m) = &cfg.metrics {
            println!("metrics written to {}", m.display());
        }
    }
    drop(comm);
    Ok(())
}
