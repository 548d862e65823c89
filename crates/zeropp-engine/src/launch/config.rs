//! [`RunConfig`]: the settings of a run, whatever the model and the data.

use std::path::PathBuf;
use std::time::Duration;

use zeropp_comm::LinkModel;

use crate::config::{AdamWConfig, EngineConfig, ZeroConfig};

/// Where the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// MPI when this process was started by an MPI launcher for a job of more
    /// than one process (OpenMPI's `mpirun`, MPICH/Hydra's `mpiexec`, Slurm's
    /// `srun`; see [`detect_job`](super::detect_job)), else threads.
    #[default]
    Auto,
    /// One OS thread per rank in this process: the `world × local_size`
    /// cluster simulated on this machine, even under an MPI launcher.
    Threads,
    /// One process per rank (feature `mpi`); the job's world and node size
    /// replace [`RunConfig::world`] and [`RunConfig::local_size`].
    Mpi,
}

impl Backend {
    /// `auto`, `threads` or `mpi`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Threads => "threads",
            Self::Mpi => "mpi",
        }
    }
}

/// Failures injected for tests (all off by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Faults {
    /// `(rank, step)`: that rank fails in the middle of that step.
    pub fail: Option<(usize, usize)>,
    /// `(rank, step)`: that rank's gradient becomes NaN at that step (the step is skipped).
    pub nan_gradient: Option<(usize, usize)>,
}

/// The settings of a run of any model on any data: the cluster, the engine's
/// ZeRO switches, batch and optimizer, the schedule, checkpoints and metrics.
/// The model and the data are the caller's ([`launch`](super::launch)); the
/// built-in ones are chosen by zeropp-run's `TrainConfig`.
///
/// ```
/// use zeropp_engine::{RunConfig, ZeroConfig};
/// // 2 simulated nodes x 2 ranks, ZeRO++ with hpZ over the node, 20 steps.
/// let run = RunConfig::on(4, 2).with_steps(20);
/// assert_eq!(run.engine.zero, ZeroConfig::zeropp(2));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// Ranks (the thread backend's simulated cluster; under MPI, the job's).
    pub world: usize,
    /// Ranks per node (under MPI, the job's; see [`Backend::Mpi`]).
    pub local_size: usize,
    /// Engine: ZeRO switches, batch, optimizer, seed.
    pub engine: EngineConfig,
    /// Optimizer steps to run (in total, including resumed ones).
    pub steps: usize,
    /// Link model (bandwidth/latency per link class) of the thread backend;
    /// an error under MPI, whose network is real.
    pub link: Option<LinkModel>,
    /// How long a rank waits for a silent peer before failing (under MPI, how
    /// long rank 0 waits for a step to finish before it aborts the job).
    pub timeout: Duration,
    /// JSON Lines metrics output (written by rank 0).
    pub metrics: Option<PathBuf>,
    /// Checkpoint directory to save into.
    pub save: Option<PathBuf>,
    /// Save every N steps (0 = only at the end) when `save` is set.
    pub save_every: usize,
    /// Checkpoint directory to resume from.
    pub resume: Option<PathBuf>,
    /// Where the ranks run.
    pub backend: Backend,
    /// Validation batches evaluated at the end (0 = no validation).
    pub eval_batches: usize,
    /// Return the final full parameters in the report (thread backend only;
    /// for tests, it costs memory).
    pub keep_params: bool,
    /// Injected failures (tests only).
    pub faults: Faults,
}

impl Default for RunConfig {
    /// `zeropp train`'s run: full ZeRO++ on 8 ranks as 2 nodes x 4, global
    /// batch 16, lr 3e-3, 800 steps.
    fn default() -> Self {
        Self {
            world: 8,
            local_size: 4,
            engine: EngineConfig {
                zero: ZeroConfig::zeropp(4),
                global_batch: 16,
                // lr 3e-3 (AdamWConfig::default): the calm regime, where ZeRO-3's own
                // validation loss spreads 0.7-1.4% over seeds (24% at 1e-2; PERFORMANCE.md).
                optim: AdamWConfig::default(),
                ..EngineConfig::default()
            },
            steps: 800,
            link: None,
            timeout: Duration::from_secs(60),
            metrics: None,
            save: None,
            save_every: 0,
            resume: None,
            backend: Backend::Auto,
            eval_batches: 4,
            keep_params: false,
            faults: Faults::default(),
        }
    }
}

impl RunConfig {
    /// The default run on `world` ranks in nodes of `local_size`, with ZeRO++'s
    /// hpZ over that node ([`ZeroConfig::zeropp`]`(local_size)`).
    pub fn on(world: usize, local_size: usize) -> Self {
        let d = Self::default();
        Self {
            world,
            local_size,
            engine: EngineConfig { zero: ZeroConfig::zeropp(local_size), ..d.engine },
            ..d
        }
    }

    /// A small, fast run for examples and tests: 2 nodes x 2, global batch 8,
    /// 5 steps, one validation batch.
    pub fn tiny() -> Self {
        let on = Self::on(4, 2);
        Self { engine: EngineConfig { global_batch: 8, ..on.engine }, steps: 5, eval_batches: 1, ..on }
    }

    /// This run with `steps` optimizer steps.
    pub fn with_steps(self, steps: usize) -> Self {
        Self { steps, ..self }
    }

    /// This run with the engine's ZeRO switches set to `zero`.
    pub fn with_zero(mut self, zero: ZeroConfig) -> Self {
        self.engine.zero = zero;
        self
    }

    /// This run on a job's cluster: its world and node size replace the
    /// configured ones, and hpZ configured over the node
    /// (`engine.zero.hpz_size == local_size > 1`, as [`ZeroConfig::zeropp`]
    /// sets it) follows the job's node size. Any other hpZ size is kept, and checked
    /// against the job's node size before the first step. Under MPI,
    /// [`launch`](super::launch) runs this; the report's summary names the
    /// cluster it ran on.
    ///
    /// ```
    /// use zeropp_engine::RunConfig;
    /// let run = RunConfig::default().on_job(4, 2); // the 8 x 4 defaults on 2 nodes x 2
    /// assert_eq!((run.world, run.local_size, run.engine.zero.hpz_size), (4, 2, 2));
    /// ```
    pub fn on_job(&self, world: usize, local_size: usize) -> RunConfig {
        let mut r = self.clone();
        if r.engine.zero.hpz() && r.engine.zero.hpz_size == self.local_size {
            r.engine.zero.hpz_size = local_size;
        }
        r.world = world;
        r.local_size = local_size;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_of_another_shape_takes_hpz_over_its_node() {
        // The defaults (8 x 4, hpZ over 4) on a job of 4 ranks in nodes of 2.
        let job = RunConfig::default().on_job(4, 2);
        assert_eq!((job.world, job.local_size, job.engine.zero.hpz_size), (4, 2, 2));
        assert!(job.engine.validate(job.world, job.local_size).is_ok());
        // An hpZ size of its own (2 of a node of 4) is kept on a node of 8.
        let own = RunConfig::default().with_zero(ZeroConfig::zeropp(4).with_hpz(2)).on_job(8, 8);
        assert_eq!(own.engine.zero.hpz_size, 2);
        // hpZ off stays off.
        let off = RunConfig::default().with_zero(ZeroConfig::zero3()).on_job(4, 2);
        assert_eq!(off.engine.zero.hpz_size, 1);
        let single = RunConfig::on(1, 1).with_zero(ZeroConfig::zero3()).on_job(8, 4);
        assert_eq!(single.engine.zero.hpz_size, 1);
    }
}
