//! Which launcher started this process, from the environment it set:
//! OpenMPI (`mpirun`), MPICH/Hydra and other PMI launchers (`mpiexec`), and
//! Slurm (`srun`).

use crate::EngineError;

/// This process's place in a job started by an MPI launcher, as the
/// launcher's environment describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// The launcher: `OpenMPI`, `PMI` (MPICH/Hydra, Intel MPI) or `Slurm`.
    pub launcher: &'static str,
    /// Processes in the job.
    pub world: usize,
    /// This process's rank.
    pub rank: usize,
    /// Processes on this process's node, when the launcher says and every node
    /// has the same number (MPI's own shared-memory split decides otherwise).
    pub local_size: Option<usize>,
}

/// Reads the environment variable `name` as a number; `None` when unset.
fn number(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>, EngineError> {
    match env(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            EngineError::InvalidConfig(format!("{name}={v:?} is not a number (set by the MPI launcher)"))
        }),
    }
}

/// Slurm's tasks-per-node list (`4(x2)`, `4,4`, `3,2(x3)`): the count when
/// every node has the same, else `None`.
fn uniform_tasks_per_node(list: &str) -> Option<usize> {
    let mut counts = list.split(',').map(|item| {
        let n = item.split('(').next().unwrap_or(item);
        n.trim().parse::<usize>().ok()
    });
    let first = counts.next()??;
    counts.all(|c| c == Some(first)).then_some(first)
}

/// The job this process belongs to, read through `env` (a lookup such as
/// `|k| std::env::var(k).ok()`), or `None` when no launcher set its variables.
///
/// | launcher | world | rank | node size |
/// |---|---|---|---|
/// | OpenMPI | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
/// | MPICH/Hydra, Intel MPI (PMI) | `PMI_SIZE` | `PMI_RANK` | `MPI_LOCALNRANKS` |
/// | Slurm `srun` (a job step) | `SLURM_STEP_NUM_TASKS` | `SLURM_PROCID` | `SLURM_STEP_TASKS_PER_NODE` |
///
/// Slurm is read from its *step* variables, which `srun` sets: a batch script
/// itself (`sbatch`, no `srun`) sees only the allocation's and is no job step.
/// A rank outside `0..world`, or a variable that is not a number, is an error.
///
/// ```
/// use zeropp_engine::launch::detect_job;
/// let env = |k: &str| match k {
///     "PMI_SIZE" => Some("4".to_string()),
///     "PMI_RANK" => Some("3".to_string()),
///     "MPI_LOCALNRANKS" => Some("2".to_string()),
///     _ => None,
/// };
/// let job = detect_job(&env)?.expect("a PMI job");
/// assert_eq!((job.launcher, job.world, job.rank, job.local_size), ("PMI", 4, 3, Some(2)));
/// assert!(detect_job(&|_: &str| None)?.is_none());
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn detect_job(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Job>, EngineError> {
    let job = if let Some(world) = number(env, "OMPI_COMM_WORLD_SIZE")? {
        let rank = number(env, "OMPI_COMM_WORLD_RANK")?;
        Some(("OpenMPI", world, rank, number(env, "OMPI_COMM_WORLD_LOCAL_SIZE")?, "OMPI_COMM_WORLD_RANK"))
    } else if let Some(world) = number(env, "PMI_SIZE")? {
        Some(("PMI", world, number(env, "PMI_RANK")?, number(env, "MPI_LOCALNRANKS")?, "PMI_RANK"))
    } else if let Some(world) = number(env, "SLURM_STEP_NUM_TASKS")? {
        let local = env("SLURM_STEP_TASKS_PER_NODE").as_deref().and_then(uniform_tasks_per_node);
        Some(("Slurm", world, number(env, "SLURM_PROCID")?, local, "SLURM_PROCID"))
    } else {
        None
    };
    let Some((launcher, world, rank, local_size, rank_var)) = job else { return Ok(None) };
    let Some(rank) = rank else {
        return Err(EngineError::InvalidConfig(format!(
            "{launcher} set the job's size ({world}) but not {rank_var}, this process's rank"
        )));
    };
    if world == 0 || rank >= world {
        return Err(EngineError::InvalidConfig(format!(
            "{launcher}: rank {rank} ({rank_var}) is outside a job of {world} processes"
        )));
    }
    Ok(Some(Job { launcher, world, rank, local_size }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
        move |k: &str| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn each_launcher_is_read_from_its_own_variables() -> Result<(), EngineError> {
        let ompi = env_of(&[
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        assert_eq!(
            detect_job(&ompi)?,
            Some(Job { launcher: "OpenMPI", world: 8, rank: 5, local_size: Some(4) })
        );
        let pmi = env_of(&[("PMI_SIZE", "6"), ("PMI_RANK", "0")]);
        assert_eq!(detect_job(&pmi)?, Some(Job { launcher: "PMI", world: 6, rank: 0, local_size: None }));
        let srun = env_of(&[
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_PROCID", "7"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
        ]);
        assert_eq!(
            detect_job(&srun)?,
            Some(Job { launcher: "Slurm", world: 8, rank: 7, local_size: Some(4) })
        );
        Ok(())
    }

    #[test]
    fn a_batch_script_without_srun_is_no_job() -> Result<(), EngineError> {
        // sbatch sets the allocation's variables; only srun sets the step's.
        let sbatch = env_of(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "0"), ("SLURM_JOB_ID", "42")]);
        assert_eq!(detect_job(&sbatch)?, None);
        Ok(())
    }

    #[test]
    fn uneven_nodes_leave_the_node_size_to_mpi() {
        assert_eq!(uniform_tasks_per_node("4(x2)"), Some(4));
        assert_eq!(uniform_tasks_per_node("4,4(x3)"), Some(4));
        assert_eq!(uniform_tasks_per_node("3,2(x3)"), None);
        assert_eq!(uniform_tasks_per_node("x"), None);
    }

    #[test]
    fn bad_variables_are_named() {
        let bad = env_of(&[("OMPI_COMM_WORLD_SIZE", "four"), ("OMPI_COMM_WORLD_RANK", "0")]);
        let e = detect_job(&bad).unwrap_err().to_string();
        assert!(e.contains("OMPI_COMM_WORLD_SIZE"), "{e}");
        let outside = env_of(&[("PMI_SIZE", "2"), ("PMI_RANK", "2")]);
        let e = detect_job(&outside).unwrap_err().to_string();
        assert!(e.contains("PMI_RANK") && e.contains("outside"), "{e}");
        let no_rank = env_of(&[("SLURM_STEP_NUM_TASKS", "2")]);
        let e = detect_job(&no_rank).unwrap_err().to_string();
        assert!(e.contains("SLURM_PROCID"), "{e}");
    }
}
