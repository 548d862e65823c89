//! `zeropp train`: the one launcher. It builds the run's configuration from
//! the flags ([`crate::config::train_config`]), then picks the backend: the
//! thread backend here, or one MPI rank per process ([`crate::train_mpi`]).
//! Both print through [`crate::print`]; the training itself is the engine's.

use zeropp_engine::train::{train_model_described, train_with};

use crate::CliError;
use crate::config::{BackendArg, TrainArgs, train_config};
use crate::print::{
    print_data, print_memory, print_plan, print_report, print_warnings, progress_bar, show_step,
};

/// Runs `zeropp train` on the backend its flags name.
pub(crate) fn run(args: &TrainArgs) -> Result<(), CliError> {
    match args.run.backend {
        BackendArg::Mpi => crate::train_mpi::run(args),
        BackendArg::Threads => run_threads(args),
    }
}

/// `zeropp train --backend threads`: every rank a thread of this process.
fn run_threads(args: &TrainArgs) -> Result<(), CliError> {
    let (cfg, warnings) = train_config(args)?;
    print_warnings(&warnings);
    cfg.engine.validate(cfg.world, cfg.local_size)?;
    print_data(&cfg.data)?;
    print_plan(&args.run.model, &cfg, cfg.world / cfg.local_size.max(1), None);
    let llama = match crate::llama::parse(&args.run.model)? {
        Some(shape) => {
            let (data, info) = zeropp_engine::train::load_data(&cfg.data)?;
            Some((shape.build(data.vocab_size())?, data, info))
        }
        None => None,
    };
    let pb = progress_bar(cfg.steps, "train");
    let report = match &llama {
        Some((model, data, info)) => {
            train_model_described(model, data, info, &cfg, &mut |r| show_step(&pb, r))
        }
        None => train_with(&cfg, &mut |r| show_step(&pb, r)),
    };
    pb.finish();
    let report = report?;
    print_report(&report.summary, cfg.metrics.as_deref());
    print_memory(&cfg, llama.as_ref().map(|(m, _, _)| m), cfg.world, None);
    Ok(())
}
