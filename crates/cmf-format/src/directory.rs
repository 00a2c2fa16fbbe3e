//! The binary tensor directory (spec §3): `u64 count`, `u64 pool_off`, `count` records of 56
//! bytes, then a UTF-8 name pool.
//!
//! ```text
//! record: u32 name_off (in pool) | u16 name_len | u8 dtype | u8 ndim (≤ 6) | u32 shape[6]
//!         | u64 offset (relative to the data section, multiple of 64) | u64 nbytes | u64 hash
//! ```
//!
//! `parse` validates every record against the data section; it allocates only in proportion
//! to the directory bytes it was given.

use crate::dtype::Dtype;
use crate::envelope::TENSOR_ALIGN;
use crate::error::Fault;
use crate::shape::{Shape, MAX_NDIM};

pub const RECORD_LEN: usize = 56;
const HEAD_LEN: usize = 16;

/// One validated directory record. The name lives in [`Directory::names`].
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    name_start: usize,
    name_len: usize,
    pub dtype: Dtype,
    pub shape: Shape,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    pub nbytes: u64,
    pub hash: u64,
}

/// The parsed directory: entries in file order plus one owned string holding all names.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    names: String,
    pub entries: Vec<Entry>,
    /// Entry indices sorted by name, for binary-search lookup.
    by_name: Vec<u32>,
}

impl Directory {
    pub fn name(&self, e: &Entry) -> &str {
        &self.names[e.name_start..e.name_start + e.name_len]
    }

    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name
            .binary_search_by(|&i| self.name(&self.entries[i as usize]).cmp(name))
            .ok()
            .map(|k| self.by_name[k] as usize)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Parses and validates a directory. `dir_off` is its absolute file offset (for error
/// messages); `data_len` the length of the data section every tensor must lie in.
///
/// Refuses: records or pool out of the section, names out of the pool or not UTF-8, unknown
/// dtype, ndim > 6, offsets not 64-aligned, tensors past the data section, `nbytes` that
/// disagrees with dtype and shape, duplicate names, overlapping tensors.
pub fn parse(dir: &[u8], dir_off: u64, data_len: u64) -> Result<Directory, Fault> {
    if dir.len() < HEAD_LEN {
        return Err(Fault::malformed(
            "dir_len",
            format!(
                "directory is {} bytes, shorter than its 16-byte head",
                dir.len()
            ),
        )
        .at(dir_off));
    }
    let count = u64_at(dir, 0);
    let pool_off = u64_at(dir, 8);
    // count·56 + 16 must fit in the section before anything is allocated for it.
    let records_end = count
        .checked_mul(RECORD_LEN as u64)
        .and_then(|n| n.checked_add(HEAD_LEN as u64))
        .filter(|&end| end <= dir.len() as u64)
        .ok_or_else(|| {
            Fault::malformed(
                "dir.count",
                format!(
                    "{count} records of 56 bytes do not fit in the {}-byte directory",
                    dir.len()
                ),
            )
            .at(dir_off)
        })? as usize;
    if pool_off < records_end as u64 || pool_off > dir.len() as u64 {
        return Err(Fault::malformed(
            "dir.pool_off",
            format!(
                "name pool offset {pool_off} must lie between the end of the records ({records_end}) \
                 and the end of the directory ({})",
                dir.len()
            ),
        )
        .at(dir_off + 8));
    }
    let pool = &dir[pool_off as usize..];
    let count = count as usize;

    let mut names = String::new();
    let mut entries = Vec::with_capacity(count);
    for i in 0..count {
        let rec_at = HEAD_LEN + i * RECORD_LEN;
        let r = &dir[rec_at..rec_at + RECORD_LEN];
        let abs = dir_off + rec_at as u64;

        let name_off = u32_at(r, 0) as usize;
        let name_len = u16_at(r, 4) as usize;
        let name_bytes = name_off
            .checked_add(name_len)
            .and_then(|end| pool.get(name_off..end))
            .ok_or_else(|| {
                Fault::malformed(
                    "name_off",
                    format!(
                        "name [{name_off}, +{name_len}) lies outside the {}-byte name pool",
                        pool.len()
                    ),
                )
                .tensor(format!("#{i}"))
                .at(abs)
            })?;
        let name = std::str::from_utf8(name_bytes).map_err(|e| {
            Fault::malformed("name", format!("tensor name is not UTF-8 ({e})"))
                .tensor(format!("#{i}"))
                .at(abs)
        })?;
        let fault = |f: Fault, rel: u64| f.tensor(name).at(abs + rel);

        let dtype_id = r[6];
        let dtype = Dtype::from_id(dtype_id).ok_or_else(|| {
            let msg = match Dtype::foreign_name(dtype_id) {
                Some(n) => format!("dtype {dtype_id} ({n}) is not implemented by this reader"),
                None => format!("unknown dtype id {dtype_id}"),
            };
            fault(Fault::unsupported("dtype", msg), 6)
        })?;
        let ndim = r[7] as usize;
        if ndim > MAX_NDIM {
            return Err(fault(
                Fault::malformed("ndim", format!("ndim {ndim} exceeds the maximum of 6")),
                7,
            ));
        }
        let mut dims64 = [0u64; MAX_NDIM];
        for (d, dim) in dims64.iter_mut().enumerate().take(ndim) {
            *dim = u32_at(r, 8 + 4 * d) as u64;
        }
        let dims64 = &dims64[..ndim];
        let offset = u64_at(r, 32);
        let nbytes = u64_at(r, 40);
        let hash = u64_at(r, 48);

        if !offset.is_multiple_of(TENSOR_ALIGN) {
            return Err(fault(
                Fault::malformed(
                    "offset",
                    format!("data offset {offset} is not a multiple of {TENSOR_ALIGN}"),
                ),
                32,
            ));
        }
        match offset.checked_add(nbytes) {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(fault(
                    Fault::malformed(
                        "nbytes",
                        format!("tensor [{offset}, +{nbytes}) runs past the data section ({data_len} bytes)"),
                    ),
                    40,
                ))
            }
        }
        let expected = dtype.expected_nbytes(dims64).ok_or_else(|| {
            let why = dtype.shape_problem(dims64).unwrap_or_default();
            fault(Fault::malformed("shape", why), 8)
        })?;
        if expected != nbytes {
            return Err(fault(
                Fault::malformed(
                    "nbytes",
                    format!(
                        "{nbytes} bytes stored, but {dtype} {dims64:?} takes exactly {expected}"
                    ),
                ),
                40,
            ));
        }
        // Every dim fits usize here: the element count is bounded by the payload size, which
        // is bounded by the file size.
        let dims: Vec<usize> = dims64.iter().map(|&d| d as usize).collect();
        let shape = Shape::new(&dims).expect("ndim checked");

        let name_start = names.len();
        names.push_str(name);
        entries.push(Entry {
            name_start,
            name_len: name.len(),
            dtype,
            shape,
            offset,
            nbytes,
            hash,
        });
    }

    let mut dir_parsed = Directory {
        names,
        entries,
        by_name: Vec::new(),
    };
    let record_at = |i: usize| dir_off + (HEAD_LEN + i * RECORD_LEN) as u64;

    let mut by_name: Vec<u32> = (0..count as u32).collect();
    by_name.sort_unstable_by(|&a, &b| {
        dir_parsed
            .name(&dir_parsed.entries[a as usize])
            .cmp(dir_parsed.name(&dir_parsed.entries[b as usize]))
    });
    for w in by_name.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        let name = dir_parsed.name(&dir_parsed.entries[b]);
        if dir_parsed.name(&dir_parsed.entries[a]) == name {
            let (first, second) = (a.min(b), a.max(b));
            return Err(Fault::malformed(
                "name",
                format!("duplicate tensor name (records #{first} and #{second})"),
            )
            .tensor(name)
            .at(record_at(second)));
        }
    }
    dir_parsed.by_name = by_name;

    // Overlap check: sort by offset; a non-empty tensor must end before the next one starts.
    let mut by_off: Vec<u32> = (0..count as u32)
        .filter(|&i| dir_parsed.entries[i as usize].nbytes > 0)
        .collect();
    by_off.sort_unstable_by_key(|&i| dir_parsed.entries[i as usize].offset);
    for w in by_off.windows(2) {
        let (a, b) = (
            &dir_parsed.entries[w[0] as usize],
            &dir_parsed.entries[w[1] as usize],
        );
        if a.offset + a.nbytes > b.offset {
            return Err(Fault::malformed(
                "offset",
                format!(
                    "tensor [{}, +{}) overlaps tensor '{}' [{}, +{})",
                    b.offset,
                    b.nbytes,
                    dir_parsed.name(a),
                    a.offset,
                    a.nbytes
                ),
            )
            .tensor(dir_parsed.name(b))
            .at(record_at(w[1] as usize) + 32));
        }
    }
    Ok(dir_parsed)
}

/// A record to encode: everything but the name's pool position, which `encode` assigns.
#[derive(Debug, Clone)]
pub struct NewEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Shape,
    pub offset: u64,
    pub nbytes: u64,
    pub hash: u64,
}

/// Encodes records in the given order with the name pool right after them. Callers
/// guarantee names ≤ 65535 bytes, dims ≤ u32::MAX and a pool under 4 GiB (the writer checks).
pub fn encode(entries: &[NewEntry]) -> Vec<u8> {
    let pool_off = HEAD_LEN + entries.len() * RECORD_LEN;
    let pool_len: usize = entries.iter().map(|e| e.name.len()).sum();
    let mut out = Vec::with_capacity(pool_off + pool_len);
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    out.extend_from_slice(&(pool_off as u64).to_le_bytes());
    let mut name_off = 0u32;
    for e in entries {
        out.extend_from_slice(&name_off.to_le_bytes());
        out.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        out.push(e.dtype.id());
        out.push(e.shape.ndim() as u8);
        for d in e.shape.as_u64() {
            out.extend_from_slice(&(d as u32).to_le_bytes());
        }
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.nbytes.to_le_bytes());
        out.extend_from_slice(&e.hash.to_le_bytes());
        name_off += e.name.len() as u32;
    }
    for e in entries {
        out.extend_from_slice(e.name.as_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, dtype: Dtype, shape: &[usize], offset: u64) -> NewEntry {
        let shape = Shape::new(shape).unwrap();
        let s64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        NewEntry {
            name: name.into(),
            dtype,
            shape,
            offset,
            nbytes: dtype.expected_nbytes(&s64).unwrap(),
            hash: 7,
        }
    }

    #[test]
    fn round_trip_and_lookup() {
        let es = [
            entry("b", Dtype::F32, &[2, 3], 0),
            entry("a", Dtype::Q8Row, &[4, 8], 64),
        ];
        let bytes = encode(&es);
        let d = parse(&bytes, 1000, 128).unwrap();
        assert_eq!(d.len(), 2);
        let a = &d.entries[d.find("a").unwrap()];
        assert_eq!(
            (a.dtype, a.shape.as_slice(), a.offset, a.nbytes),
            (Dtype::Q8Row, &[4usize, 8][..], 64, 40)
        );
        assert_eq!(d.find("c"), None);
    }

    #[test]
    fn refusals() {
        let fault = |es: &[NewEntry], data_len| parse(&encode(es), 0, data_len).unwrap_err();
        let f = fault(
            &[
                entry("x", Dtype::F32, &[4], 0),
                entry("x", Dtype::F32, &[4], 64),
            ],
            128,
        );
        assert_eq!((f.field, f.tensor.as_deref()), ("name", Some("x")));
        let f = fault(
            &[
                entry("x", Dtype::F32, &[32], 0),
                entry("y", Dtype::F32, &[4], 64),
            ],
            256,
        );
        assert_eq!((f.field, f.tensor.as_deref()), ("offset", Some("y")));
        let f = fault(&[entry("x", Dtype::F32, &[4], 32)], 256);
        assert_eq!(f.field, "offset");
        let f = fault(&[entry("x", Dtype::F32, &[4], 64)], 70);
        assert_eq!(f.field, "nbytes");
        let mut e = entry("x", Dtype::F32, &[4], 0);
        e.nbytes = 15;
        assert_eq!(fault(&[e], 64).field, "nbytes");

        let mut raw = encode(&[entry("x", Dtype::F32, &[4], 0)]);
        raw[16 + 6] = 8; // vbit
        let f = parse(&raw, 0, 64).unwrap_err();
        assert!(f.message.contains("vbit"), "{f}");
        raw[16 + 6] = 0;
        raw[16 + 7] = 7;
        assert_eq!(parse(&raw, 0, 64).unwrap_err().field, "ndim");
        raw[16 + 7] = 1;
        let pool = 16 + 56;
        raw[pool] = 0xff;
        assert_eq!(parse(&raw, 0, 64).unwrap_err().field, "name");
        raw[0] = 200;
        assert_eq!(parse(&raw, 0, 64).unwrap_err().field, "dir.count");
    }
}
