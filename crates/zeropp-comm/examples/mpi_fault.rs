//! MPI fault test: run under `mpirun` (see `xtask/mpi-tests.sh`).
//!
//! `mpi_fault MODE`: every rank runs all-gathers in a loop; at iteration 3 the last
//! rank fails according to `MODE` while its peers wait in the next collective:
//!
//! - `ok`: nobody fails (the control run: exits 0);
//! - `error`: the last rank returns an error (through `or_abort` → `MPI_Abort`);
//! - `panic`: the last rank panics (the communicator's drop during unwinding aborts);
//! - `exit`: the last rank exits the process with status 3, without telling MPI;
//! - `topology`: only builds the communicator (for inconsistent `ZEROPP_LOCAL_SIZE`).
//!
//! The script asserts that every fault ends the whole job non-zero within a timeout.

use zeropp_comm::mpi::{MpiComm, MpiOptions};
use zeropp_comm::{CommError, CommExt, Communicator, Group};

fn run(mode: &str) -> Result<(), CommError> {
    let mut comm = MpiComm::init(MpiOptions::default())?;
    if mode == "topology" {
        return Ok(());
    }
    let world = Group::world(comm.topology());
    let me = comm.rank();
    let last = world.size() - 1;
    for k in 0..6u32 {
        if k == 3 && me == last {
            match mode {
                "error" => return Err(CommError::InvalidConfig(format!("injected fault on rank {me}"))),
                "panic" => panic!("injected panic on rank {me}"),
                "exit" => std::process::exit(3),
                _ => {}
            }
        }
        let mut all = vec![0u32; world.size()];
        comm.all_gather(&world, &[k], &mut all)?;
        if all.iter().any(|&v| v != k) {
            return Err(CommError::Mismatch("wrong all_gather data".into()));
        }
    }
    if me == 0 {
        println!("mpi_fault {mode}: completed");
    }
    Ok(())
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "ok".to_string());
    zeropp_comm::mpi::or_abort(|| run(&mode));
}
