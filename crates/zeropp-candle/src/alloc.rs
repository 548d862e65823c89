//! One allocator setting that candle training on the CPU wants.
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
