//! Checked windows into buffers.
//!
//! Library code never indexes a buffer with a computed range and never falls back to
//! an empty slice when a range is out of bounds (that would turn an indexing bug into
//! silently missing data). A window that does not fit is a [`CommError::Mismatch`]
//! naming the buffer; zero-length windows (empty shards, padding-only parts) are valid.

use crate::CommError;

fn outside(what: &str, start: usize, len: usize, total: usize) -> CommError {
    CommError::Mismatch(format!(
        "{what}: window of {len} elements at offset {start} lies outside a buffer of {total}"
    ))
}

/// `buf[start..start + len]`, or a [`CommError::Mismatch`] naming `what`.
pub(crate) fn window<'a, T>(
    buf: &'a [T],
    start: usize,
    len: usize,
    what: &str,
) -> Result<&'a [T], CommError> {
    let total = buf.len();
    start.checked_add(len).and_then(|end| buf.get(start..end)).ok_or_else(|| outside(what, start, len, total))
}

/// `&mut buf[start..start + len]`, or a [`CommError::Mismatch`] naming `what`.
pub(crate) fn window_mut<'a, T>(
    buf: &'a mut [T],
    start: usize,
    len: usize,
    what: &str,
) -> Result<&'a mut [T], CommError> {
    let total = buf.len();
    match start.checked_add(len) {
        Some(end) => buf.get_mut(start..end).ok_or_else(|| outside(what, start, len, total)),
        None => Err(outside(what, start, len, total)),
    }
}

/// Chunk `index` of `len` elements: `buf[index·len..(index + 1)·len]`, checked.
pub(crate) fn chunk<'a, T>(buf: &'a [T], index: usize, len: usize, what: &str) -> Result<&'a [T], CommError> {
    let start = index.checked_mul(len).ok_or_else(|| outside(what, usize::MAX, len, buf.len()))?;
    window(buf, start, len, what)
}

/// Copies `src` into `dst` at `at`, checked.
pub(crate) fn copy_to<T: Copy>(dst: &mut [T], at: usize, src: &[T], what: &str) -> Result<(), CommError> {
    window_mut(dst, at, src.len(), what)?.copy_from_slice(src);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may unwrap

    use super::*;

    #[test]
    fn windows_are_checked_and_empty_windows_are_valid() {
        let v = [1, 2, 3, 4, 5];
        assert_eq!(window(&v, 1, 3, "v").unwrap(), &[2, 3, 4]);
        assert_eq!(window(&v, 5, 0, "v").unwrap(), &[] as &[i32]);
        assert_eq!(chunk(&v, 1, 2, "v").unwrap(), &[3, 4]);
        assert_eq!(chunk(&v, 9, 0, "v").unwrap(), &[] as &[i32]);
        let e = chunk(&v, 2, 2, "the send buffer").unwrap_err();
        assert_eq!(
            e,
            CommError::Mismatch(
                "the send buffer: window of 2 elements at offset 4 lies outside a buffer of 5".into()
            )
        );
        assert!(window(&v, usize::MAX, 2, "v").is_err());
        assert!(chunk(&v, usize::MAX, 2, "v").is_err());
        let mut w = [0; 4];
        copy_to(&mut w, 1, &[7, 8], "w").unwrap();
        assert_eq!(w, [0, 7, 8, 0]);
        assert!(copy_to(&mut w, 3, &[7, 8], "w").is_err());
        window_mut(&mut w, 2, 2, "w").unwrap().fill(1);
        assert_eq!(w, [0, 7, 1, 1]);
        assert!(window_mut(&mut w, 2, usize::MAX, "w").is_err());
    }
}
