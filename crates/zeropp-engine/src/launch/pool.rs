//! Each rank's compute threads: the host's cores divided among the ranks on it.
//!
//! The model's parallel loops (`model::ops`, the quantization kernels) run on
//! the current rayon pool. Under MPI each rank is a process, so its global
//! pool is sized once ([`threads_per_rank`]). On the thread backend every
//! rank is a thread of one process: before [`on_rank_pool`], all of them fed
//! one global pool, so each parallel loop of each rank, even a 32-element
//! one, was handed to that pool and waited for (a futex wake-up and sleep per
//! loop, the ranks' loops queued behind each other). Now each rank runs on its
//! own pool of `cores / ranks` threads, so a rank's loop runs on its own
//! thread, or split over its own share of the cores. The results do not
//! depend on the pool: each loop writes disjoint rows or chunks, and every sum
//! runs inside one of them, in order.

/// Compute threads for one of `ranks_on_host` ranks sharing this host's cores:
/// the available cores divided among them, at least 1. `None` when the user
/// chose (`RAYON_NUM_THREADS`, which rayon reads itself) or there is nothing to
/// divide.
pub(super) fn threads_per_rank(
    env: &dyn Fn(&str) -> Option<std::ffi::OsString>,
    cores: usize,
    ranks_on_host: usize,
) -> Option<usize> {
    if env("RAYON_NUM_THREADS").is_some() || ranks_on_host <= 1 {
        return None;
    }
    Some((cores / ranks_on_host).max(1))
}

/// The host's cores as the standard library sees them (cgroup and affinity
/// limits included), at least 1.
pub(super) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// A pool of [`threads_per_rank`] threads for rank `rank`, one of
/// `ranks_on_host` threads of this process, or `None` where the global pool
/// stays in use: one rank, the user's `RAYON_NUM_THREADS`, or a pool that
/// cannot start (then the rank runs as before, only slower).
pub(super) fn rank_pool(rank: usize, ranks_on_host: usize, stack_size: usize) -> Option<rayon::ThreadPool> {
    let n = threads_per_rank(&|k| std::env::var_os(k), cores(), ranks_on_host)?;
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(move |i| format!("zeropp-rank-{rank}-compute-{i}"))
        .stack_size(stack_size)
        .build()
        .ok()
}

/// Runs `f` on `pool` (its parallel loops split over that pool alone), or here
/// when there is none.
pub(super) fn on_rank_pool<T: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> T + Send) -> T {
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_a_host_share_its_cores() {
        let unset = |_: &str| None;
        assert_eq!(threads_per_rank(&unset, 2, 4), Some(1), "more ranks than cores: one each");
        assert_eq!(threads_per_rank(&unset, 16, 4), Some(4));
        assert_eq!(threads_per_rank(&unset, 16, 3), Some(5));
        assert_eq!(threads_per_rank(&unset, 16, 1), None, "one rank keeps rayon's default");
        let chosen = |k: &str| (k == "RAYON_NUM_THREADS").then(|| "3".into());
        assert_eq!(threads_per_rank(&chosen, 16, 4), None, "the user's RAYON_NUM_THREADS wins");
    }
}
