//! `zeropp train`: one path. The flags (and a DeepSpeed file) become a
//! `TrainConfig` ([`crate::config::train_config`]); the model and the data are
//! built from it; the engine's one door, [`zeropp_engine::Launch`], picks the
//! backend (threads, or one MPI rank per process under a launcher) and runs
//! them; everything printed comes from [`crate::print`], on rank 0.

use std::cell::Cell;

use indicatif::ProgressDrawTarget;
use zeropp_engine::data::{DataInfo, TextDataset};
use zeropp_engine::metrics::StepRecord;
use zeropp_engine::{Backend, Launch, Model, Started, launch::detect_job};
use zeropp_run::train::TrainConfig;

use crate::CliError;
use crate::config::{TrainArgs, faults_from_env, flag_given, train_config};
use crate::print::{
    print_data, print_memory, print_plan, print_report, print_warnings, progress_bar, show_step,
};

/// Runs `zeropp train` as its flags say.
pub(crate) fn run(args: &TrainArgs) -> Result<(), CliError> {
    let crate::config::Planned { mut cfg, warnings } = train_config(args)?;
    cfg.run.faults = faults_from_env()?;
    // Under a launcher the world is the job's: an explicit --world must agree.
    if let Some(job) = detect_job(&|k| std::env::var(k).ok())?
        && cfg.run.backend != Backend::Threads
        && job.world > 1
        && flag_given("--world")
        && job.world != cfg.run.world
    {
        return Err(format!(
            "--world {} does not match the MPI world of {} processes that {} started (mpirun -np, srun -n)",
            cfg.run.world, job.world, job.launcher
        )
        .into());
    }
    let (model, data, info) = cfg.build()?;
    go(args, &cfg, &warnings, &model, &data, info)
}

/// Launches `model` on `data` and prints the run: the plan when it starts (rank
/// 0), the progress, the summary (rank 0) and each process's memory line.
fn go<M: Model>(
    args: &TrainArgs,
    cfg: &TrainConfig,
    warnings: &[String],
    model: &M,
    data: &TextDataset,
    info: DataInfo,
) -> Result<(), CliError> {
    // Hidden until rank 0 is known: only rank 0 draws.
    let pb = progress_bar(cfg.run.steps, "train");
    pb.set_draw_target(ProgressDrawTarget::hidden());
    let backend = Cell::new(Backend::Threads);
    let mut on_start = |s: &Started| {
        backend.set(s.backend);
        if s.rank == 0 {
            print_warnings(warnings);
            print_data(&info);
            print_plan(&args.run.model, &cfg.run, s);
            pb.set_draw_target(ProgressDrawTarget::stderr());
        }
    };
    let mut on_step = |r: &StepRecord| show_step(&pb, r);
    let mut launch = Launch::new(model, data, &cfg.run)
        .describe(info.clone())
        .on_start(&mut on_start)
        .on_step(&mut on_step);
    if flag_given("--local-size") {
        launch = launch.node_size(cfg.run.local_size);
    }
    let report = launch.run();
    pb.finish();
    let report = report?;
    let s = &report.summary;
    if report.rank == 0 {
        print_report(s, cfg.run.metrics.as_deref());
    }
    // The memory model of the run as it ran (under MPI, the job's cluster); with
    // threads this process holds every rank, under MPI one.
    let ran = cfg.run.on_job(s.world, s.local_size);
    match backend.get() {
        Backend::Mpi => print_memory(model, &ran, 1, Some(report.rank)),
        _ => print_memory(model, &ran, s.world, None),
    }
    Ok(())
}
