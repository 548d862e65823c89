//! The only `unsafe` of the MPI backend: moving MPI communicator handles between
//! threads.
//!
//! rsmpi's `SimpleCommunicator` wraps a raw `MPI_Comm`, which OpenMPI defines as a
//! pointer, so the type is neither `Send` nor `Sync`. [`crate::Communicator`]
//! requires `Send` (the engine moves a duplicated communicator to its prefetch
//! thread), hence this one wrapper.

use ::mpi::topology::SimpleCommunicator;

/// An owned MPI communicator that may be moved to another thread.
///
/// The backend upholds the MPI threading rules itself: when the library provides
/// less than `MPI_THREAD_MULTIPLE`, every MPI call of [`super::MpiComm`] first
/// checks that it runs on the thread that initialized MPI (and fails otherwise),
/// and a handle dropped on another thread is leaked instead of freed.
pub(crate) struct SendComm(SimpleCommunicator);

// SAFETY: an `MPI_Comm` is a process-wide handle, not tied to the creating thread;
// MPI permits using it from any thread when initialized with MPI_THREAD_MULTIPLE.
// Below that level `MpiComm` refuses (at run time, before touching MPI) every call
// made off the initializing thread, so no MPI call ever runs on a thread MPI does not
// allow. The wrapper is not `Sync`: concurrent use of one handle is impossible
// through `&mut MpiComm`.
unsafe impl Send for SendComm {}

impl SendComm {
    /// Wraps a communicator.
    pub(crate) fn new(comm: SimpleCommunicator) -> Self {
        Self(comm)
    }

    /// The wrapped communicator.
    pub(crate) fn get(&self) -> &SimpleCommunicator {
        &self.0
    }

    /// Gives the handle up without `MPI_Comm_free` (for drops on a thread that MPI
    /// does not allow to call it).
    pub(crate) fn leak(self) {
        std::mem::forget(self.0);
    }
}
