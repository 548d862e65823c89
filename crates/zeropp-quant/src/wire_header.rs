//! The fixed constants of the wire header, below everything else in the
//! crate: the error messages quote them, and `wire` (which re-exports them)
//! reads and writes them.

/// Bytes in the fixed header.
pub const HEADER_LEN: usize = 32;
/// The wire format version this build writes and reads.
pub const VERSION: u16 = 1;
/// The magic bytes at offset 0.
pub const MAGIC: [u8; 4] = *b"ZPPQ";
