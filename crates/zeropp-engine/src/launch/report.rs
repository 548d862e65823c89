//! What a run hands back and what its drivers are handed: the
//! [`TrainReport`] every process gets, the [`Started`] notice of
//! [`Launch::on_start`](super::Launch::on_start), and the [`Work`] the thread
//! and MPI drivers run. Below the drivers and the door alike, so neither
//! reaches up for them.

use zeropp_comm::Topology;

use super::config::{Backend, RunConfig};
use super::detect::Job;
use crate::data::{DataInfo, TextDataset};
use crate::metrics::{StepRecord, Summary};
use crate::model::Model;

/// The outcome of a run, on every process.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// One record per step run (resumed steps excluded), aggregated over all ranks.
    pub steps: Vec<StepRecord>,
    /// The final summary.
    pub summary: Summary,
    /// The final full parameters, one vector per bucket of the plan: per layer,
    /// then the persistent parameters when there are any (when `keep_params`).
    pub params: Option<Vec<Vec<f32>>>,
    /// This process's rank: 0 on the thread backend; under MPI, print where 0.
    pub rank: usize,
}

/// What [`Launch::on_start`](super::Launch::on_start) is told once the backend is up, before the first step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// The backend the run resolved to: [`Backend::Threads`] or [`Backend::Mpi`].
    pub backend: Backend,
    /// This process's rank (0 on the thread backend).
    pub rank: usize,
    /// The cluster: the simulated one, or the MPI job's.
    pub topology: Topology,
    /// The launcher's view of the job, when one started this process.
    pub job: Option<Job>,
    /// The thread level MPI granted (under MPI).
    pub mpi_thread_level: Option<String>,
    /// Compute threads of this process (rayon's pool). Under MPI, without
    /// `RAYON_NUM_THREADS`, the cores divided among the ranks on this host (at
    /// least one), as torchrun sets `OMP_NUM_THREADS=1`: rayon's default of every
    /// core per rank oversubscribes the host, and spinning idle workers then take
    /// the cores from the rank that is computing.
    pub threads: usize,
}

/// What a driver runs: the model, the data and its description, the settings.
pub(crate) struct Work<'a, M: Model> {
    /// The model.
    pub(crate) model: &'a M,
    /// The data.
    pub(crate) data: &'a TextDataset,
    /// The data's description, for the summary.
    pub(crate) info: &'a DataInfo,
    /// The run's settings.
    pub(crate) run: &'a RunConfig,
}

impl<M: Model> Clone for Work<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M: Model> Copy for Work<'_, M> {}
