//! The thread backend: every rank is an OS thread of this process.
//!
//! [`ThreadCluster::run`] starts `world` threads, gives each a [`ThreadComm`] and
//! returns every rank's result. Transfers are per-pair crossbeam channels carrying
//! `Arc<[u8]>` windows: a sender copies its buffer once into a shared allocation
//! that all receivers read (all-gather and broadcast share one allocation between
//! all peers), and each receiver copies its window into the caller's buffer.
//!
//! # Byte formulas of the primitives
//!
//! Traffic is counted per message with its *payload* (the backend's small header
//! is not counted; self-sends are not traffic). With `g = group.size()` and the
//! caller at group index `i`, every primitive sends exactly one message to every
//! other member (`g - 1` messages, even when empty) except broadcast. The
//! [`Communicator`](crate::Communicator) trait's provided methods count these
//! figures for every backend once the backend's hook succeeded (a rejected or
//! failed call counts nothing), so the table holds for all of them:
//!
//! | primitive | bytes sent by the caller | bytes received |
//! |---|---|---|
//! | `all_gather_bytes(send = c bytes)` | `c` to each of the `g-1` others | `c` from each |
//! | `all_to_all_bytes(send = c·g bytes)` | `c` to each other member | `c` from each |
//! | `all_to_all_v_bytes` | `send_counts[j]` to member `j ≠ i` | `recv_counts[j]` from `j ≠ i` |
//! | `reduce_scatter_f32(recv = n floats)` | `4n` to each other member | `4n` from each |
//! | `all_reduce_f32(n floats)` | reduce-scatter + all-gather of `k = ⌈n/g⌉` floats: `2·4k` to each other member in `2(g-1)` messages | the same |
//! | `broadcast_bytes(n bytes)` | root: `n` to each other member; others: nothing | non-root: `n` from the root |
//! | `barrier` | `0` bytes, one message to each other member | one empty message from each |
//! | `duplicate` | nothing | nothing |
//!
//! Each bullet is split by the peer's node into intra-node and inter-node counters.
//!
//! # Faults
//!
//! A rank whose closure panics or returns (early or not) is announced to every
//! peer on every channel set; a peer's pending or later receive from it fails with
//! [`CommError::PeerLost`] as soon as the messages it sent before are consumed.
//! A silent but live peer gives [`CommError::Timeout`] after
//! [`ThreadOptions::timeout`].

mod comm;
mod fabric;

use std::any::Any;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

pub use comm::ThreadComm;
use fabric::{Fabric, ROOT_SET};

use crate::{CommError, LinkModel, Topology};

/// Options of a [`ThreadCluster`].
#[derive(Debug, Clone, PartialEq)]
pub struct ThreadOptions {
    /// How long a receive waits for a silent (but not lost) peer before failing
    /// with [`CommError::Timeout`]. Lost peers are reported at once.
    pub timeout: Duration,
    /// Optional bandwidth/latency model enforced in wall-clock time (off by default).
    pub link_model: Option<LinkModel>,
}

impl Default for ThreadOptions {
    /// A 60 s timeout and no link model.
    fn default() -> Self {
        Self { timeout: Duration::from_secs(60), link_model: None }
    }
}

impl ThreadOptions {
    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with a link model.
    pub fn with_link_model(mut self, model: LinkModel) -> Self {
        self.link_model = Some(model);
        self
    }
}

/// Why one rank of [`ThreadCluster::run`] did not produce a value.
#[derive(Debug)]
pub enum RunError<E> {
    /// The rank's closure panicked.
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// The rank's closure returned an error.
    Failed {
        /// The rank.
        rank: usize,
        /// Its error.
        error: E,
    },
    /// The cluster could not start the rank.
    Setup(CommError),
}

impl<E> RunError<E> {
    /// The rank this error belongs to (None for setup errors).
    pub fn rank(&self) -> Option<usize> {
        match self {
            RunError::Panicked { rank, .. } | RunError::Failed { rank, .. } => Some(*rank),
            RunError::Setup(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Panicked { rank, message } => write!(f, "rank {rank} panicked: {message}"),
            RunError::Failed { rank, error } => write!(f, "rank {rank} failed: {error}"),
            RunError::Setup(e) => write!(f, "thread cluster setup failed: {e}"),
        }
    }
}

/// Implemented for any displayable rank error (so `RunError<String>` works with `?`
/// too); the rank's error is part of the message rather than a `source`.
impl<E: fmt::Display + fmt::Debug> std::error::Error for RunError<E> {}

/// A simulated cluster of `nodes × local_size` ranks, one OS thread each.
#[derive(Debug, Clone)]
pub struct ThreadCluster {
    topology: Topology,
    options: ThreadOptions,
}

/// Stack size of each rank thread, bytes (models recurse little, but kernels
/// may use big frames); a rank's compute threads take the same.
pub const RANK_STACK: usize = 16 << 20;

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

impl ThreadCluster {
    /// A cluster of `topology.world()` ranks.
    pub fn new(topology: Topology, options: ThreadOptions) -> Self {
        Self { topology, options }
    }

    /// The cluster's topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The cluster's options.
    pub fn options(&self) -> &ThreadOptions {
        &self.options
    }

    /// Runs `f` on every rank (one thread each) and returns every rank's value, in
    /// rank order, or the first failure: a panic (lowest rank) if any rank panicked,
    /// else the lowest rank's error. Peers of a failed rank see
    /// [`CommError::PeerLost`] in their pending collectives instead of hanging.
    ///
    /// ```
    /// use zeropp_comm::{CommExt, Communicator, Group, ThreadCluster, ThreadOptions, Topology};
    /// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
    /// let sums = cluster.run(|comm| {
    ///     let world = Group::world(comm.topology());
    ///     let mut x = [comm.rank() as f32, 1.0];
    ///     comm.all_reduce_f32(&world, &mut x)?;
    ///     Ok::<_, zeropp_comm::CommError>(x)
    /// })?;
    /// assert!(sums.iter().all(|s| *s == [6.0, 4.0]));
    ///
    /// // A rank that panics is named, and nobody hangs.
    /// let err = cluster
    ///     .run(|comm| {
    ///         if comm.rank() == 2 {
    ///             panic!("boom");
    ///         }
    ///         comm.barrier(&Group::world(comm.topology()))
    ///     })
    ///     .unwrap_err();
    /// assert_eq!(err.rank(), Some(2));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn run<T, E, F>(&self, f: F) -> Result<Vec<T>, RunError<E>>
    where
        F: Fn(&mut ThreadComm) -> Result<T, E> + Sync,
        T: Send,
        E: Send,
    {
        first_failure(self.run_each(f))
    }

    /// Runs `f` on every rank and returns each rank's own outcome, in rank order
    /// (for fault tests: which ranks failed and how).
    pub fn run_each<T, E, F>(&self, f: F) -> Vec<Result<T, RunError<E>>>
    where
        F: Fn(&mut ThreadComm) -> Result<T, E> + Sync,
        T: Send,
        E: Send,
    {
        let fabric = Arc::new(Fabric::new(self.topology, self.options.link_model));
        // Create the root channel set before any rank starts.
        let _ = fabric.channel_set(ROOT_SET);
        let timeout = self.options.timeout;
        run_ranks(
            self.topology.world(),
            "zeropp-rank",
            |rank| ThreadComm::new(rank, Arc::clone(&fabric), ROOT_SET, timeout),
            |rank, reason| fabric.mark_lost(rank, reason),
            &f,
        )
    }
}

/// Every rank's value in rank order, or the first failure: a panic (lowest rank)
/// if any rank panicked, else the lowest rank's error. The `run` of both
/// [`ThreadCluster`] and the device cluster.
pub(crate) fn first_failure<T, E>(results: Vec<Result<T, RunError<E>>>) -> Result<Vec<T>, RunError<E>> {
    let mut values = Vec::with_capacity(results.len());
    let mut first_err: Option<RunError<E>> = None;
    for r in results {
        match r {
            Ok(v) => values.push(v),
            Err(e) => {
                let better = match (&first_err, &e) {
                    (None, _) => true,
                    (Some(RunError::Panicked { .. }), _) => false,
                    (Some(_), RunError::Panicked { .. }) => true,
                    _ => false,
                };
                if better {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(values),
    }
}

/// The rank threads of a simulated cluster, written once for [`ThreadCluster`] and
/// the device cluster: one scoped thread `{name}-{rank}` per rank of `world`, which
/// makes its communicator with `start(rank)`, runs `f` on it (catching a panic),
/// drops it and announces its end with `lost(rank, reason)` (so peers fail with
/// [`CommError::PeerLost`] instead of hanging); a rank that cannot start or be
/// spawned is announced too. Returns each rank's outcome, in rank order.
pub(crate) fn run_ranks<C, T, E, F>(
    world: usize,
    name: &str,
    start: impl Fn(usize) -> Result<C, CommError> + Sync,
    lost: impl Fn(usize, &str) + Sync,
    f: &F,
) -> Vec<Result<T, RunError<E>>>
where
    F: Fn(&mut C) -> Result<T, E> + Sync,
    T: Send,
    E: Send,
{
    let (start, lost) = (&start, &lost);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = move || -> Result<T, RunError<E>> {
                    let mut comm = match start(rank) {
                        Ok(c) => c,
                        Err(e) => {
                            lost(rank, &format!("rank {rank} could not start: {e}"));
                            return Err(RunError::Setup(e));
                        }
                    };
                    let out = catch_unwind(AssertUnwindSafe(|| f(&mut comm)));
                    drop(comm);
                    let (reason, res) = match out {
                        Ok(Ok(v)) => (format!("rank {rank} finished"), Ok(v)),
                        Ok(Err(error)) => {
                            (format!("rank {rank} returned an error"), Err(RunError::Failed { rank, error }))
                        }
                        Err(p) => {
                            let message = panic_message(p.as_ref());
                            (
                                format!("rank {rank} panicked: {message}"),
                                Err(RunError::Panicked { rank, message }),
                            )
                        }
                    };
                    lost(rank, &reason);
                    res
                };
                let spawned = std::thread::Builder::new()
                    .name(format!("{name}-{rank}"))
                    .stack_size(RANK_STACK)
                    .spawn_scoped(scope, body);
                if spawned.is_err() {
                    lost(rank, "its thread could not be spawned");
                }
                spawned
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|p| Err(RunError::Panicked { rank, message: panic_message(p.as_ref()) })),
                Err(e) => {
                    Err(RunError::Setup(CommError::InvalidConfig(format!("cannot spawn rank {rank}: {e}"))))
                }
            })
            .collect()
    })
}
