//! The engine's one door: [`launch`] runs any [`Model`] on any
//! [`TextDataset`] with ZeRO-3 or ZeRO++, on threads or under MPI, with the
//! same call.
//!
//! - On a laptop or in a test, the ranks are threads of this process, the
//!   `world × local_size` cluster of the [`RunConfig`] simulated on one machine.
//! - Started by an MPI launcher (`mpirun`, `mpiexec`, `srun`; [`detect_job`]),
//!   each process is one rank and the topology is the job's (feature `mpi`).
//!   [`Backend`] overrides the choice.
//!
//! Both run the same per-rank loop, so with the default ordered reduction the
//! losses, norms and byte counters under MPI equal those of threads with the
//! same world and node size. Every process gets the [`TrainReport`]; rank 0
//! writes the metrics file and sees [`Launch::on_step`].
//!
//! ```
//! use zeropp_engine::data::TextDataset;
//! use zeropp_engine::{Gpt, GptConfig, RunConfig, launch};
//! // Any Model; here the built-in GPT on token ids from a tokenizer of your own.
//! let model = Gpt::new(GptConfig::tiny().with_vocab(32))?;
//! let tokens: Vec<u32> = (0..5000u32).map(|i| (i * i + 3 * i) % 32).collect();
//! let data = TextDataset::from_tokens(32, tokens, 0.1)?;
//! let report = launch(&model, &data, &RunConfig::tiny().with_steps(3))?;
//! assert_eq!(report.steps.len(), 3);
//! assert_eq!(report.summary.bytes_per_step, report.summary.model_bytes_per_step);
//! # Ok::<(), zeropp_engine::EngineError>(())
//! ```
//!
//! The files, in the order a run passes through them: `config` (the
//! [`RunConfig`]), `detect` (the launcher's environment), `preflight` (the
//! checks before any rank starts), `threads` and `mpi` (the two drivers),
//! `rank` (the loop of one rank, generic over the communicator), `aggregate`
//! (one step's per-rank records become one [`StepRecord`]), `failure` (which
//! failing rank is the root cause), `summary` (the run's [`Summary`]) and
//! `report` (the [`TrainReport`], [`Started`] and the drivers' work, below
//! both drivers and this door).
//!
//! [`Summary`]: crate::metrics::Summary

use zeropp_comm::Topology;

use crate::EngineError;
use crate::data::{DataInfo, TextDataset};
use crate::engine::memory::MemoryPrediction;
use crate::metrics::StepRecord;
use crate::model::Model;

mod aggregate;
mod config;
mod detect;
mod failure;
#[cfg(feature = "mpi")]
mod mpi;
mod pool;
mod preflight;
mod rank;
mod report;
mod summary;
mod threads;

pub use config::{Backend, Faults, RunConfig};
pub use detect::{Job, detect_job};
pub(crate) use report::Work;
pub use report::{Started, TrainReport};

/// A per-step callback.
type OnStep<'a> = &'a mut dyn FnMut(&StepRecord);
/// The start callback.
type OnStart<'a> = &'a mut dyn FnMut(&Started);
/// An environment lookup.
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A run of `model` on `data` as `run` says, with its options; [`Launch::run`]
/// starts it. [`launch`] is this with no options.
///
/// ```
/// use zeropp_engine::data::{DataChoice, load_data};
/// use zeropp_engine::{Gpt, GptConfig, Launch, RunConfig};
/// let (data, info) = load_data(&DataChoice::Markov { seed: 1, chars: 20_000 })?;
/// let model = Gpt::new(GptConfig::tiny().with_vocab(data.vocab_size()))?;
/// let mut seen = Vec::new();
/// let report = Launch::new(&model, &data, &RunConfig::tiny().with_steps(2))
///     .describe(info)
///     .on_step(&mut |r| seen.push(r.step))
///     .run()?;
/// assert_eq!(seen, [0, 1]);
/// assert!(report.summary.entropy_rate.is_some()); // the generated text's loss floor
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub struct Launch<'a, M: Model> {
    model: &'a M,
    data: &'a TextDataset,
    run: &'a RunConfig,
    info: Option<DataInfo>,
    on_start: Option<OnStart<'a>>,
    on_step: Option<OnStep<'a>>,
    node_size: Option<usize>,
    env: Option<Env<'a>>,
    /// Whether this build can run under an MPI launcher (`cfg!(feature = "mpi")`;
    /// tests of a build without it set it off in either build).
    mpi_built: bool,
}

impl<'a, M: Model> Launch<'a, M> {
    /// A run of `model` on `data` with the settings of `run`.
    pub fn new(model: &'a M, data: &'a TextDataset, run: &'a RunConfig) -> Self {
        Self {
            model,
            data,
            run,
            info: None,
            on_start: None,
            on_step: None,
            node_size: None,
            env: None,
            mpi_built: cfg!(feature = "mpi"),
        }
    }

    /// Describes the data in the summary (its description and, when known, its
    /// loss floor), as [`load_data`](crate::data::load_data) returns it.
    pub fn describe(mut self, info: DataInfo) -> Self {
        self.info = Some(info);
        self
    }

    /// Calls `f` on every process once the backend is up, before the first step.
    pub fn on_start(mut self, f: OnStart<'a>) -> Self {
        self.on_start = Some(f);
        self
    }

    /// Calls `f` after every optimizer step with the record aggregated over all
    /// ranks, in step order, on rank 0's process only (the calling thread).
    pub fn on_step(mut self, f: OnStep<'a>) -> Self {
        self.on_step = Some(f);
        self
    }

    /// Under MPI, the job's node size is `n` (instead of `ZEROPP_LOCAL_SIZE` or
    /// MPI's shared-memory split): for simulated nodes on one host.
    pub fn node_size(mut self, n: usize) -> Self {
        self.node_size = Some(n);
        self
    }

    /// Reads the launcher's variables through `env` instead of the process
    /// environment (tests of the detection).
    #[cfg(test)]
    pub(crate) fn environment(mut self, env: Env<'a>) -> Self {
        self.env = Some(env);
        self
    }

    /// Runs as a build without the `mpi` feature would (tests of its error,
    /// which so run in both builds).
    #[cfg(test)]
    pub(crate) fn built_without_mpi(mut self) -> Self {
        self.mpi_built = false;
        self
    }

    /// The backend this run resolves to, and the launcher's job when there is one.
    fn resolve(&self) -> Result<(Backend, Option<Job>), EngineError> {
        let process_env = |k: &str| std::env::var(k).ok();
        let job = detect_job(self.env.unwrap_or(&process_env))?;
        let backend = match self.run.backend {
            Backend::Auto if job.as_ref().is_some_and(|j| j.world > 1) => Backend::Mpi,
            Backend::Auto => Backend::Threads,
            b => b,
        };
        Ok((backend, job))
    }

    /// Runs it: every step, then validation, then the report.
    ///
    /// Errors before the first step (configuration, data, topology) are
    /// returned on every process. Under MPI, an error on one rank once the job
    /// is up ends the whole job through `MPI_Abort`, with a message naming the
    /// rank and the cause, so no peer waits forever; and rank 0 aborts the job
    /// when no step completes within [`RunConfig::timeout`].
    pub fn run(self) -> Result<TrainReport, EngineError> {
        let (backend, job) = self.resolve()?;
        let info = self.info.clone().unwrap_or_else(|| DataInfo::of(self.data, describe_tokens(self.data)));
        let mut no_start = |_: &Started| {};
        let mut no_step = |_: &StepRecord| {};
        let on_start = self.on_start.unwrap_or(&mut no_start);
        let on_step = self.on_step.unwrap_or(&mut no_step);
        let work = Work { model: self.model, data: self.data, info: &info, run: self.run };
        match backend {
            Backend::Mpi => {
                if self.run.link.is_some() {
                    return Err(EngineError::InvalidConfig(
                        "`link` (a modelled network) shapes the thread backend only: under MPI the \
                         network is real; unset it"
                            .into(),
                    ));
                }
                if self.run.keep_params {
                    return Err(EngineError::InvalidConfig(
                        "`keep_params` is supported on the thread backend only".into(),
                    ));
                }
                #[cfg(feature = "mpi")]
                if self.mpi_built {
                    return mpi::run(work, job, self.node_size, on_start, on_step);
                }
                // Compiled in both builds (so one clippy run lints it): with the
                // feature an MPI build returned above.
                debug_assert!(!self.mpi_built, "a build without the mpi feature cannot run MPI");
                Err(no_mpi_feature(job))
            }
            _ => {
                // The field-naming checks first (world, local_size, hpz_size).
                self.run.engine.validate(self.run.world, self.run.local_size)?;
                let topology = Topology::ranks(self.run.world)
                    .per_node(self.run.local_size)
                    .map_err(EngineError::InvalidTopology)?;
                on_start(&Started {
                    backend,
                    rank: 0,
                    topology,
                    job,
                    mpi_thread_level: None,
                    threads: rayon::current_num_threads(),
                });
                threads::run(work, topology, on_step)
            }
        }
    }
}

/// The error of a run that needs MPI in a build without the `mpi` feature.
fn no_mpi_feature(job: Option<Job>) -> EngineError {
    let who = match job {
        Some(j) => format!("this process is rank {} of {} under {}, but ", j.rank, j.world, j.launcher),
        None => String::new(),
    };
    EngineError::InvalidConfig(format!(
        "{who}zeropp-engine was built without the `mpi` feature: rebuild with `--features mpi`, or \
         set `backend` to Backend::Threads to simulate the cluster in each process"
    ))
}

/// Runs `model` on `data` as `run` says and returns the report (see the
/// [module docs](self) for threads and MPI, and [`Launch`] for the options).
///
/// The data's vocabulary must not exceed the model's (a clear error otherwise),
/// and the model's layer names must be unique and not `persistent`
/// ([`crate::engine::check_layers`]). See [`Model`] for an example model.
///
/// ```
/// use zeropp_engine::data::TextDataset;
/// use zeropp_engine::{Gpt, GptConfig, RunConfig, launch};
/// let tokens: Vec<u32> = (0..5000u32).map(|i| (i * 7 + 1) % 32).collect();
/// let data = TextDataset::from_tokens(32, tokens, 0.1)?;
/// // A model with a smaller vocabulary than the data is refused.
/// let small = Gpt::new(GptConfig::tiny().with_vocab(16))?;
/// let err = launch(&small, &data, &RunConfig::tiny()).unwrap_err();
/// assert!(err.to_string().contains("exceeds model"), "{err}");
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn launch<M: Model>(model: &M, data: &TextDataset, run: &RunConfig) -> Result<TrainReport, EngineError> {
    Launch::new(model, data, run).run()
}

/// The memory model's per-rank prediction for training `model` as `run` says
/// (see [`crate::engine::memory`]).
pub fn memory_prediction<M: Model>(model: &M, run: &RunConfig) -> Result<MemoryPrediction, EngineError> {
    use crate::engine::{build_plan, memory::predict};
    let topo = Topology::ranks(run.world).per_node(run.local_size).map_err(EngineError::InvalidTopology)?;
    let micro = run.engine.micro_batch(run.world)?;
    predict(model, &build_plan(model, &run.engine, topo)?, &run.engine, micro)
}

/// The one-line description of a dataset given as tokens.
fn describe_tokens(data: &TextDataset) -> String {
    format!(
        "{} training and {} validation tokens, vocabulary {}",
        data.train_tokens().len(),
        data.val_tokens().len(),
        data.vocab_size()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Gpt, GptConfig};

    fn tiny() -> Result<(Gpt, TextDataset), EngineError> {
        let model = Gpt::new(GptConfig::tiny().with_vocab(16))?;
        let tokens: Vec<u32> = (0..4000u32).map(|i| (i * 5 + 3) % 16).collect();
        Ok((model, TextDataset::from_tokens(16, tokens, 0.1)?))
    }

    /// A PMI job of four processes.
    fn pmi(k: &str) -> Option<String> {
        match k {
            "PMI_SIZE" => Some("4".into()),
            "PMI_RANK" => Some("1".into()),
            _ => None,
        }
    }

    #[test]
    fn auto_picks_mpi_under_a_launcher_and_threads_otherwise() -> Result<(), EngineError> {
        let (model, data) = tiny()?;
        let run = RunConfig::tiny();
        let none = |_: &str| None;
        let l = Launch::new(&model, &data, &run).environment(&none);
        assert_eq!(l.resolve()?, (Backend::Threads, None));
        let l = Launch::new(&model, &data, &run).environment(&pmi);
        assert_eq!(l.resolve()?.0, Backend::Mpi);
        // An explicit backend wins over the environment.
        let threads = RunConfig { backend: Backend::Threads, ..RunConfig::tiny() };
        let l = Launch::new(&model, &data, &threads).environment(&pmi);
        assert_eq!(l.resolve()?.0, Backend::Threads);
        // A job of one process is no reason for MPI.
        let one = |k: &str| match k {
            "OMPI_COMM_WORLD_SIZE" => Some("1".into()),
            "OMPI_COMM_WORLD_RANK" => Some("0".into()),
            _ => None,
        };
        let l = Launch::new(&model, &data, &run).environment(&one);
        assert_eq!(l.resolve()?.0, Backend::Threads);
        Ok(())
    }

    #[test]
    fn a_launcher_without_the_mpi_feature_is_a_clear_error() -> Result<(), EngineError> {
        let (model, data) = tiny()?;
        let run = RunConfig::tiny();
        let l = Launch::new(&model, &data, &run).environment(&pmi).built_without_mpi();
        let e = l.run().unwrap_err().to_string();
        assert!(e.contains("rank 1 of 4 under PMI") && e.contains("--features mpi"), "{e}");
        Ok(())
    }

    #[test]
    fn thread_runs_report_rank_zero_and_start_once() -> Result<(), EngineError> {
        let (model, data) = tiny()?;
        let run = RunConfig { backend: Backend::Threads, ..RunConfig::tiny().with_steps(2) };
        let mut started = Vec::new();
        let report = Launch::new(&model, &data, &run).on_start(&mut |s| started.push(s.clone())).run()?;
        assert_eq!(report.rank, 0);
        assert_eq!(started.len(), 1);
        assert_eq!((started[0].backend, started[0].topology.world()), (Backend::Threads, 4));
        Ok(())
    }

    #[test]
    fn mpi_only_settings_are_refused_before_the_job_starts() -> Result<(), EngineError> {
        let (model, data) = tiny()?;
        let run = RunConfig { backend: Backend::Mpi, keep_params: true, ..RunConfig::tiny() };
        let e = launch(&model, &data, &run).unwrap_err().to_string();
        assert!(e.contains("keep_params"), "{e}");
        Ok(())
    }
}
