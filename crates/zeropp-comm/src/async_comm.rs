//! Non-blocking collectives: a communicator on a worker thread, driven by handles.
//!
//! [`AsyncComm`] owns a communicator (normally a [`Communicator::duplicate`] of the
//! rank's main one, so its collectives never interleave with the main stream) on a
//! dedicated worker thread. [`AsyncComm::submit`] queues a job and returns a
//! [`Pending`] handle at once; jobs run in submission order, so every rank must
//! submit the same jobs in the same order (exactly as for blocking collectives).
//! This lets the engine prefetch the next layer's gather while it computes.
//! It works with every backend: it only needs a `Box<dyn Communicator>`.
//!
//! ```
//! use zeropp_comm::{AsyncComm, CommExt, Group, ThreadCluster, ThreadOptions, Topology};
//! let cluster = ThreadCluster::new(Topology::ranks(2).per_node(2)?, ThreadOptions::default());
//! cluster.run(|comm| {
//!     let prefetch = AsyncComm::duplicate_from(comm)?;
//!     let group = Group::world(comm.topology());
//!     let shard = vec![comm.rank() as f32; 3];
//!     let pending = prefetch.submit(move |c| {
//!         let mut full = vec![0.0f32; 6];
//!         c.all_gather(&group, &shard, &mut full)?;
//!         Ok(full)
//!     });
//!     // ... compute here while the gather runs ...
//!     assert_eq!(pending.wait()?, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
//!     Ok::<_, zeropp_comm::CommError>(())
//! })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, bounded, unbounded};

use crate::{CommError, Communicator, Topology, TrafficSnapshot};

type Job = Box<dyn FnOnce(&mut dyn Communicator) + Send>;

/// A communicator running collectives on its own worker thread.
pub struct AsyncComm {
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    rank: usize,
    topology: Topology,
}

/// The handle of a submitted job; [`Pending::wait`] blocks for its result.
#[must_use = "a pending collective must be waited for"]
pub struct Pending<T> {
    rx: Receiver<Result<T, CommError>>,
}

impl<T> Pending<T> {
    /// Blocks until the job finished and returns its result.
    pub fn wait(self) -> Result<T, CommError> {
        self.rx.recv().unwrap_or_else(|_| Err(closed()))
    }

    /// Like [`Pending::wait`], but gives up after `timeout` (returning the handle).
    pub fn wait_timeout(self, timeout: Duration) -> Result<Result<T, CommError>, Self> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Disconnected) => Ok(Err(closed())),
            Err(RecvTimeoutError::Timeout) => Err(self),
        }
    }

    /// The result if the job is done, else the handle back.
    pub fn try_wait(self) -> Result<Result<T, CommError>, Self> {
        match self.rx.try_recv() {
            Ok(r) => Ok(r),
            Err(TryRecvError::Disconnected) => Ok(Err(closed())),
            Err(TryRecvError::Empty) => Err(self),
        }
    }

    /// True once the job has finished (successfully or not).
    pub fn is_ready(&self) -> bool {
        !self.rx.is_empty()
    }
}

fn closed() -> CommError {
    CommError::Closed(
        "the worker stopped before finishing the job (a job panicked or the AsyncComm was dropped)".into(),
    )
}

impl AsyncComm {
    /// Moves `comm` onto a new worker thread.
    pub fn new(comm: Box<dyn Communicator>) -> Result<Self, CommError> {
        let rank = comm.rank();
        let topology = *comm.topology();
        let (tx, rx) = unbounded::<Job>();
        let worker = std::thread::Builder::new()
            .name(format!("zeropp-comm-worker-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                for job in rx {
                    job(comm.as_mut());
                }
            })
            .map_err(|e| CommError::Closed(format!("cannot spawn the communication worker: {e}")))?;
        Ok(Self { jobs: Some(tx), worker: Some(worker), rank, topology })
    }

    /// Collective: duplicates `comm` (a second, independent stream) and moves the
    /// duplicate onto a worker thread.
    pub fn duplicate_from<C: Communicator + ?Sized>(comm: &mut C) -> Result<Self, CommError> {
        Self::new(comm.duplicate()?)
    }

    /// The rank of the owned communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The topology of the owned communicator.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Queues `job` (run with the worker's communicator) and returns its handle.
    /// Buffers move into the job and come back in its result.
    pub fn submit<T, F>(&self, job: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn Communicator) -> Result<T, CommError> + Send + 'static,
    {
        let (tx, rx) = bounded(1);
        let wrapped: Job = Box::new(move |c: &mut dyn Communicator| {
            let _ = tx.send(job(c));
        });
        if let Some(jobs) = &self.jobs {
            // If the worker is gone the job is dropped with its sender, and `wait`
            // reports `Closed`.
            let _ = jobs.send(wrapped);
        }
        Pending { rx }
    }

    /// A snapshot of the worker communicator's traffic counters (queued behind the
    /// jobs already submitted).
    pub fn traffic(&self) -> Pending<TrafficSnapshot> {
        self.submit(|c| Ok(c.traffic().snapshot()))
    }

    /// Sets the worker communicator's operation tag for the jobs submitted after.
    pub fn set_op(&self, tag: &str) -> Pending<()> {
        let tag = tag.to_string();
        self.submit(move |c| {
            c.traffic_mut().set_op(&tag);
            Ok(())
        })
    }

    /// Stops accepting jobs, waits for the queued ones and joins the worker.
    pub fn shutdown(mut self) -> Result<(), CommError> {
        self.jobs = None;
        match self.worker.take() {
            Some(w) => w.join().map_err(|_| CommError::Closed("the communication worker panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for AsyncComm {
    /// Closes the queue; the worker finishes the queued jobs and exits on its own
    /// (it is not joined, so dropping during a panic never blocks).
    fn drop(&mut self) {
        self.jobs = None;
        self.worker = None;
    }
}
