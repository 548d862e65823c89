//! The MPI backend (feature `mpi`): real processes and hosts, launched by `mpirun`.
//!
//! ```no_run
//! use zeropp_comm::mpi::{MpiComm, MpiOptions};
//! use zeropp_comm::{CommExt, Communicator, Group};
//!
//! zeropp_comm::mpi::or_abort(|| {
//!     let mut comm = MpiComm::init(MpiOptions::default())?; // collective over the world
//!     let world = Group::world(comm.topology());
//!     let mine = [comm.rank() as u32];
//!     let mut all = vec![0u32; world.size()];
//!     comm.all_gather(&world, &mine, &mut all)?;
//!     Ok::<_, zeropp_comm::CommError>(())
//! });
//! ```
//!
//! # Mapping of the primitives
//!
//! [`MpiComm`] runs every [`Communicator`](crate::Communicator) primitive on the MPI
//! library's own collectives, so jobs use its tuned algorithms. `f32` reductions
//! default to an exchange plus a local sum in group order, because the trait
//! promises the thread backend's exact sums (see [`Reduction`]):
//!
//! | primitive | MPI call |
//! |---|---|
//! | `all_gather_bytes` | `MPI_Allgather` (`MPI_UINT8_T`) |
//! | `all_to_all_bytes` | `MPI_Alltoall` |
//! | `all_to_all_v_bytes` | `MPI_Alltoall` of the counts (validation), then `MPI_Alltoallv` |
//! | `reduce_scatter_f32` | `MPI_Alltoall` + a local sum in group order ([`Reduction::Ordered`], the default), or `MPI_Reduce_scatter_block(MPI_SUM)` ([`Reduction::Native`]) |
//! | `all_reduce_f32` | `MPI_Alltoall` + local sum + `MPI_Allgather` (ordered), or `MPI_Allreduce(MPI_SUM)` (native) |
//! | `broadcast_bytes` | `MPI_Bcast` |
//! | `barrier` | `MPI_Barrier` |
//! | `duplicate` | `MPI_Comm_dup` |
//!
//! Groups: the world in rank order uses the communicator's private duplicate of
//! `MPI_COMM_WORLD`; any other group gets a sub-communicator from
//! `MPI_Comm_create_group` (collective over the group's members only, so it is
//! created when all members call their first collective on the group) and is
//! cached by its member list. Groups of one member never call MPI.
//!
//! # Validation
//!
//! The local argument checks (group, buffer lengths, counts, root) are the
//! [`Communicator`](crate::Communicator) trait's, with the same words as on every
//! backend; a rank whose arguments they reject still joins the agreement round
//! below ([`Communicator::raw_reject`](crate::Communicator::raw_reject)), so its
//! peers fail too. Ranks that disagree on sizes get [`CommError::Mismatch`] on
//! every member, never garbage or a hang:
//!
//! - With [`MpiOptions::check_sizes`] (the default), every fixed-size primitive is
//!   preceded by one `MPI_Allreduce(MAX)` of a few integers: the chunk length (and
//!   the broadcast root) as `v` and `MAX - v`, so every member sees the min and max,
//!   plus a flag "my arguments were invalid". A local error (e.g. a receive buffer
//!   of the wrong size) is therefore reported on *all* members.
//! - `all_to_all_v_bytes` is always validated: an `MPI_Alltoall` tells each member
//!   what every peer will send it, which it compares with its `recv_counts`, then the
//!   flag round makes all members agree.
//! - Without `check_sizes`, local errors are returned locally before any MPI call
//!   (peers that did call the collective then wait, so treat errors as fatal and
//!   [`abort`]), and a size mismatch between ranks is undefined behaviour in MPI
//!   terms (typically `MPI_ERR_TRUNCATE`, which aborts the job under MPI's default
//!   error handler).
//! - Buffers above MPI's `int` count limit (2^31 - 1 elements) are rejected.
//!
//! # Traffic accounting
//!
//! The [`TrafficCounter`](crate::TrafficCounter) records exactly what the thread
//! backend records, because the [`Communicator`](crate::Communicator) trait's
//! provided methods count it for both (the table in [`crate::threads`]): one
//! logical message per peer and primitive, `g - 1` messages even when empty,
//! broadcast only root → members, `all_reduce_f32` as reduce-scatter + all-gather
//! of `⌈n/g⌉` floats. The validation rounds and whatever MPI's algorithms put on
//! the wire are not counted, so a collective gives the same counters on both
//! backends.
//!
//! # Topology
//!
//! The node size comes from [`MpiOptions::local_size`], else the environment
//! variable [`LOCAL_SIZE_ENV`] (`ZEROPP_LOCAL_SIZE`), else the size of the
//! `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` split. The override simulates several
//! nodes on one host (`mpirun -np 8 -x ZEROPP_LOCAL_SIZE=2` gives 4 nodes of 2).
//! Start-up fails with [`CommError::InvalidConfig`] on every rank if ranks disagree
//! on the source or value of the node size, if it does not divide the world, or if
//! the ranks of a physical node are not a contiguous, aligned block of world ranks.
//!
//! # Threads
//!
//! MPI is initialized with `MPI_THREAD_MULTIPLE` when the library offers it
//! ([`Mpi::thread_level`] says what it provided). Below that level, every call of
//! an [`MpiComm`] must run on the thread that initialized MPI, which is checked: a
//! call from another thread returns [`CommError::InvalidConfig`] without touching
//! MPI (so a duplicated communicator can only feed a prefetch thread with
//! `MPI_THREAD_MULTIPLE`).
//!
//! # Faults
//!
//! An MPI job cannot survive a lost rank, so fatal errors end the whole job:
//! [`abort`] and [`or_abort`] print the reason with the rank and call `MPI_Abort`,
//! and dropping an [`MpiComm`] or the [`Mpi`] handle while the thread panics aborts
//! too. mpirun then kills every rank and exits non-zero. Errors inside MPI itself
//! use MPI's default handler (`MPI_ERRORS_ARE_FATAL`), which also aborts the job.

mod comm;
mod ffi;
mod topology;

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use ::mpi::environment::{Threading, Universe};
use ::mpi::topology::{Communicator as _, SimpleCommunicator};

pub use comm::MpiComm;
pub use topology::LOCAL_SIZE_ENV;

use crate::CommError;

/// The thread support an MPI library provides (`MPI_THREAD_*`), weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ThreadLevel {
    /// `MPI_THREAD_SINGLE`: one thread only.
    Single,
    /// `MPI_THREAD_FUNNELED`: only the initializing thread calls MPI.
    Funneled,
    /// `MPI_THREAD_SERIALIZED`: any thread, never two at once.
    Serialized,
    /// `MPI_THREAD_MULTIPLE`: any thread, concurrently.
    Multiple,
}

impl From<Threading> for ThreadLevel {
    fn from(t: Threading) -> Self {
        match t {
            Threading::Single => ThreadLevel::Single,
            Threading::Funneled => ThreadLevel::Funneled,
            Threading::Serialized => ThreadLevel::Serialized,
            Threading::Multiple => ThreadLevel::Multiple,
        }
    }
}

impl fmt::Display for ThreadLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ThreadLevel::Single => "MPI_THREAD_SINGLE",
            ThreadLevel::Funneled => "MPI_THREAD_FUNNELED",
            ThreadLevel::Serialized => "MPI_THREAD_SERIALIZED",
            ThreadLevel::Multiple => "MPI_THREAD_MULTIPLE",
        })
    }
}

/// How [`MpiComm`] reduces `f32` data.
///
/// The [`Communicator`](crate::Communicator) contract (and the conformance suite,
/// `zeropp_comm::conformance`, feature `conformance`) wants sums in group order,
/// exactly as the thread backend computes them; only [`Reduction::Ordered`]
/// guarantees that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Exchange with `MPI_Alltoall` (and `MPI_Allgather` for all-reduce) and sum
    /// locally in group order, starting from zero: bit-identical to the thread
    /// backend, so runs reproduce across backends. Same logical traffic as the
    /// thread backend's algorithm. The default.
    #[default]
    Ordered,
    /// The MPI library's `MPI_Reduce_scatter_block` / `MPI_Allreduce` with `MPI_SUM`:
    /// its tuned algorithms, but a summation order of its choosing (results may
    /// differ from the group-order sum in the last bits, so the conformance suite's
    /// exact reduction checks do not apply).
    Native,
}

/// Options of [`Mpi::communicator`] / [`MpiComm::init`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiOptions {
    /// Ranks per (simulated) node; overrides [`LOCAL_SIZE_ENV`] and the
    /// shared-memory detection (e.g. from a `--local-size` flag).
    pub local_size: Option<usize>,
    /// Validate sizes across the group before every fixed-size primitive (one small
    /// `MPI_Allreduce`; see the module docs). On by default.
    pub check_sizes: bool,
    /// How `f32` reductions are computed.
    pub reduction: Reduction,
}

impl Default for MpiOptions {
    /// Detected node size, size checks on, [`Reduction::Ordered`].
    fn default() -> Self {
        Self { local_size: None, check_sizes: true, reduction: Reduction::Ordered }
    }
}

impl MpiOptions {
    /// These options with an explicit node size.
    pub fn with_local_size(mut self, local_size: usize) -> Self {
        self.local_size = Some(local_size);
        self
    }

    /// These options with size checks on or off.
    pub fn with_check_sizes(mut self, check: bool) -> Self {
        self.check_sizes = check;
        self
    }

    /// These options with another reduction mode.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// The initialized MPI library of this process, shared by its communicators.
pub(crate) struct Env {
    /// Finalizes MPI when dropped (None once given up).
    universe: Mutex<Option<Universe>>,
    level: ThreadLevel,
    init_thread: ThreadId,
}

impl Env {
    /// Fails when MPI may not be called from this thread (below `MPI_THREAD_MULTIPLE`,
    /// only the initializing thread may call it).
    pub(crate) fn check_thread(&self) -> Result<(), CommError> {
        if self.level >= ThreadLevel::Multiple || std::thread::current().id() == self.init_thread {
            Ok(())
        } else {
            Err(CommError::InvalidConfig(format!(
                "MPI provides only {}: an MPI communicator may only be used on the thread that initialized MPI",
                self.level
            )))
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::thread::panicking() {
            abort(1, "a thread panicked while MPI was in use");
        }
        let universe = self.universe.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if self.check_thread().is_err() {
            // MPI_Finalize is not allowed on this thread; leave it to process exit.
            std::mem::forget(universe);
            return;
        }
        if OR_ABORT_DEPTH.load(Ordering::SeqCst) > 0 {
            // Inside `or_abort`: MPI_Finalize waits for every rank, so it must not run
            // before `or_abort` knows whether to abort instead.
            *lock(&DEFERRED_FINALIZE) = universe;
        }
        // Otherwise `universe` drops here: MPI_Finalize.
    }
}

/// Number of active [`or_abort`] scopes.
static OR_ABORT_DEPTH: AtomicUsize = AtomicUsize::new(0);
/// The MPI universe whose finalization an [`or_abort`] scope deferred.
static DEFERRED_FINALIZE: Mutex<Option<Universe>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The MPI library of this process: initialize it once, then build communicators.
///
/// MPI is finalized when this handle and every communicator built from it have been
/// dropped (they share it).
#[derive(Clone)]
pub struct Mpi {
    env: Arc<Env>,
}

impl fmt::Debug for Mpi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mpi").field("thread_level", &self.env.level).finish()
    }
}

impl Mpi {
    /// Initializes MPI, asking for `MPI_THREAD_MULTIPLE`; fails if MPI is already
    /// initialized in this process.
    pub fn init() -> Result<Mpi, CommError> {
        let (universe, provided) = ::mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| CommError::InvalidConfig("MPI is already initialized in this process".into()))?;
        Ok(Mpi {
            env: Arc::new(Env {
                universe: Mutex::new(Some(universe)),
                level: provided.into(),
                init_thread: std::thread::current().id(),
            }),
        })
    }

    /// The thread support MPI provided (asked: `MPI_THREAD_MULTIPLE`).
    pub fn thread_level(&self) -> ThreadLevel {
        self.env.level
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        usize::try_from(SimpleCommunicator::world().rank()).unwrap_or(0)
    }

    /// The number of processes in `MPI_COMM_WORLD`.
    pub fn size(&self) -> usize {
        usize::try_from(SimpleCommunicator::world().size()).unwrap_or(0)
    }

    /// Builds a world communicator (collective over `MPI_COMM_WORLD`): duplicates
    /// the world and detects the topology (see the module docs).
    pub fn communicator(&self, options: MpiOptions) -> Result<MpiComm, CommError> {
        MpiComm::new(Arc::clone(&self.env), options)
    }

    /// Ends the whole job (see [`abort`]).
    pub fn abort(&self, code: i32, message: &str) -> ! {
        abort(code, message)
    }
}

/// Ends the whole MPI job: prints `message` with this rank to stderr and calls
/// `MPI_Abort(MPI_COMM_WORLD, code)`; mpirun then stops every rank and exits
/// non-zero. Without an active MPI it exits the process with `code`.
pub fn abort(code: i32, message: &str) -> ! {
    let code = if code == 0 { 1 } else { code };
    let active = ::mpi::environment::is_initialized() && !::mpi::environment::is_finalized();
    if active {
        let world = SimpleCommunicator::world();
        eprintln!(
            "zeropp mpi: rank {} of {}: fatal: {message}; aborting the job (MPI_Abort, code {code})",
            world.rank(),
            world.size()
        );
        world.abort(code)
    }
    eprintln!("zeropp mpi: fatal: {message} (exit code {code})");
    std::process::exit(code)
}

/// Runs `f` and ends the whole job with [`abort`] if it returns an error or panics,
/// so one rank's failure never leaves its peers waiting in a collective.
///
/// Use it around everything a rank does with MPI (typically the body of `main`):
/// MPI is finalized only after `f` succeeded, because `MPI_Finalize` waits for every
/// rank and would hang if this rank failed while its peers still wait for it. (A
/// plain `main` returning an error would finalize first and hang the job.)
pub fn or_abort<T, E: fmt::Display>(f: impl FnOnce() -> Result<T, E>) -> T {
    OR_ABORT_DEPTH.fetch_add(1, Ordering::SeqCst);
    let outcome = catch_unwind(AssertUnwindSafe(f));
    let depth = OR_ABORT_DEPTH.fetch_sub(1, Ordering::SeqCst) - 1;
    match outcome {
        Ok(Ok(v)) => {
            if depth == 0 {
                // Finalize what the scope deferred (if MPI was shut down inside it).
                let universe = lock(&DEFERRED_FINALIZE).take();
                drop(universe);
            }
            v
        }
        Ok(Err(e)) => abort(1, &e.to_string()),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            abort(1, &format!("panicked: {msg}"))
        }
    }
}
