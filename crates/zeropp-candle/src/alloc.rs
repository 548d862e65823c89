//! The allocator calls that candle training on the CPU wants.
//!
//! candle allocates a fresh buffer for every op's output. glibc's malloc
//! serves the large ones (from 128 KiB, adapting upward) with `mmap` and
//! hands them back to the kernel when freed, so the next op's buffer
//! page-faults in again, zeroed by the kernel: in a profile of the candle
//! Llama on one rank, page faults and the kernel's page clearing took 15-20%
//! of the step. [`retain_freed_memory`] keeps freed memory in the process
//! instead. The process's peak RSS stays what it was (measured with the CLI:
//! 0.96 and 0.95 of the memory model, without and with it).

/// Tells glibc's malloc to serve allocations up to 256 MiB from its heap
/// (not `mmap`) and to return freed memory to the kernel only above 512 MiB.
/// Call it once at the start of `main`, before training starts; `zeropp
/// train` does. Returns whether the setting took (false off glibc, where it
/// does nothing).
///
/// ```
/// let applied = zeropp_candle::alloc::retain_freed_memory();
/// assert_eq!(applied, cfg!(all(target_os = "linux", target_env = "gnu")));
/// ```
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` sets two of glibc malloc's tunables; it takes
        // plain integers, reads or writes no memory of ours, and takes the
        // allocator's own lock, so it may be called at any time from any thread.
        let (mmap, trim) = unsafe {
            (
                libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20),
                libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20),
            )
        };
        mmap == 1 && trim == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Hands the heap's free pages back to the kernel now (glibc's
/// `malloc_trim(0)`, every arena), whatever [`retain_freed_memory`] set.
/// `CandleModelBuilder::build` calls it after its gradient check, whose
/// buffers (one stage's weights in f32 and f64, its gradients and graph) are
/// freed on the building thread: kept, they would sit in a heap arena that
/// training's threads do not allocate from, and count in every rank's resident
/// peak. Returns whether memory was released (false off glibc, where it does
/// nothing).
///
/// ```
/// let _released: bool = zeropp_candle::alloc::release_freed_memory();
/// ```
pub fn release_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` takes a plain integer (the padding to keep at
        // the top of the heap) and only returns the allocator's own free pages
        // to the kernel under the allocator's locks; no memory of ours is read
        // or written, and live allocations are untouched.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
