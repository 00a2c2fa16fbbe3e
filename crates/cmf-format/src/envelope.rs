//! The fixed 128-byte envelope at offset 0 (spec §1): magic, version, feature bits, and the
//! (offset, length) of every section. Sections are found only through it, never by order.
//!
//! ```text
//! 0x00 magic "CMF\x01" | 0x04 version u32 = 2 | 0x08 flags u32 | 0x0C required_features u32
//! 0x10 header | 0x20 dir | 0x30 data | 0x40 masks | 0x50 vocab | 0x60 index   (u64 off, u64 len)
//! 0x70 hash64(header JSON) | 0x78 hash64(directory)            (0 = absent)
//! ```

use crate::error::Fault;

pub const MAGIC: [u8; 4] = *b"CMF\x01";
pub const VERSION: u32 = 2;
pub const ENVELOPE_LEN: usize = 128;
/// The data section starts on a page boundary so it can be mapped and paged per tensor.
pub const DATA_ALIGN: u64 = 4096;
/// Every tensor offset (relative to the data section) is a multiple of this.
pub const TENSOR_ALIGN: u64 = 64;
/// Tensors of at least this many bytes are page-aligned (writer choice; readers need only 64).
pub const LARGE_TENSOR_MIN: u64 = 16 * 1024;
pub const LARGE_TENSOR_ALIGN: u64 = 4096;

/// `required_features` bits (spec §1.1 and cortiq-core 0.8.54 `format::features`).
pub mod features {
    pub const TENSOR_DIR: u32 = 1 << 0;
    pub const BINARY_MASKS: u32 = 1 << 1;
    pub const QUANT_2F: u32 = 1 << 2;
    /// The bits this reader implements. Any other set bit makes `open` refuse the file:
    /// the bits are *required* features, so ignoring one would misread the model.
    pub const SUPPORTED: u32 = TENSOR_DIR | QUANT_2F;

    /// Names of the bits the reference reader knows, for error messages.
    pub fn name(bit: u32) -> &'static str {
        match bit {
            0 => "TENSOR_DIR",
            1 => "BINARY_MASKS (task masks)",
            2 => "QUANT_2F",
            3 => "DELTA_MASKS",
            4 => "HOT_PACKS",
            5 => "LOOP_MASKS",
            6 => "SKILL_FILE (standalone skill)",
            7 => "PRISM_HADAMARD",
            8 => "PRISM_AFFINE",
            9 => "SKILLS_V2",
            10 => "ROUTER_V2",
            11 => "DECISION",
            12 => "BOUNDED_STATE",
            13 => "GENOME",
            15 => "BLOCK_DIFFUSION",
            _ => "unknown",
        }
    }
}

/// The six sections the envelope addresses, in envelope order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Section {
    Header,
    Directory,
    Data,
    Masks,
    Vocab,
    Index,
}

impl Section {
    pub const ALL: [Section; 6] = [
        Section::Header,
        Section::Directory,
        Section::Data,
        Section::Masks,
        Section::Vocab,
        Section::Index,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Section::Header => "header",
            Section::Directory => "dir",
            Section::Data => "data",
            Section::Masks => "masks",
            Section::Vocab => "vocab",
            Section::Index => "index",
        }
    }

    /// Byte offset of this section's `off` field in the envelope (its `len` follows at +8).
    pub fn envelope_offset(self) -> u64 {
        0x10 + 16 * self as u64
    }

    fn off_field(self) -> &'static str {
        match self {
            Section::Header => "header_off",
            Section::Directory => "dir_off",
            Section::Data => "data_off",
            Section::Masks => "masks_off",
            Section::Vocab => "vocab_off",
            Section::Index => "index_off",
        }
    }

    fn len_field(self) -> &'static str {
        match self {
            Section::Header => "header_len",
            Section::Directory => "dir_len",
            Section::Data => "data_len",
            Section::Masks => "masks_len",
            Section::Vocab => "vocab_len",
            Section::Index => "index_len",
        }
    }
}

/// A byte range of the file. `len == 0` means the section is absent, whatever `off` says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Span {
    pub off: u64,
    pub len: u64,
}

impl Span {
    pub fn new(off: u64, len: u64) -> Self {
        Span { off, len }
    }

    pub fn is_present(self) -> bool {
        self.len > 0
    }

    /// End offset; only meaningful once `Envelope::parse` has checked it does not overflow.
    pub fn end(self) -> u64 {
        self.off + self.len
    }

    /// As a `usize` range into the mapped file (valid after `Envelope::parse`).
    pub fn range(self) -> std::ops::Range<usize> {
        self.off as usize..(self.off + self.len) as usize
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u32,
    pub required_features: u32,
    /// Indexed by `Section as usize`.
    pub sections: [Span; 6],
    /// hash64 of the header JSON bytes; 0 = not recorded.
    pub header_hash: u64,
    /// hash64 of the directory bytes; 0 = not recorded.
    pub dir_hash: u64,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

impl Envelope {
    pub fn section(&self, s: Section) -> Span {
        self.sections[s as usize]
    }

    pub fn set_section(&mut self, s: Section, span: Span) {
        self.sections[s as usize] = span;
    }

    /// Parses and validates the envelope of a file of `file_len` bytes whose first bytes are
    /// `head` (at least 128 of them unless the file is shorter).
    ///
    /// Checks: magic, version, feature bits, every present section inside the file and past
    /// the envelope, header and directory present, data section page-aligned.
    pub fn parse(head: &[u8], file_len: u64) -> Result<Envelope, Fault> {
        if file_len < ENVELOPE_LEN as u64 || head.len() < ENVELOPE_LEN {
            return Err(Fault::malformed(
                "envelope",
                format!(
                    "file is {file_len} bytes, shorter than the {ENVELOPE_LEN}-byte CMF envelope"
                ),
            ));
        }
        if head[0..4] != MAGIC {
            return Err(Fault::malformed(
                "magic",
                format!(
                    "expected 43 4d 46 01 (\"CMF\\x01\"), found {:02x?}: not a CMF file",
                    &head[0..4]
                ),
            )
            .at(0));
        }
        let version = u32_at(head, 4);
        if version != VERSION {
            return Err(Fault::unsupported(
                "version",
                format!("CMF version {version}; this reader reads version 2"),
            )
            .at(4));
        }
        let required_features = u32_at(head, 12);
        let unknown = required_features & !features::SUPPORTED;
        if unknown != 0 {
            let bits: Vec<String> = (0..32)
                .filter(|b| unknown & (1 << b) != 0)
                .map(|b| format!("bit {b} {}", features::name(b)))
                .collect();
            return Err(Fault::unsupported(
                "required_features",
                format!(
                    "file requires features this reader does not implement: {}",
                    bits.join(", ")
                ),
            )
            .at(12));
        }
        if required_features & features::TENSOR_DIR == 0 {
            return Err(Fault::malformed(
                "required_features",
                "bit 0 (TENSOR_DIR) is clear; every CMF v2 file has a tensor directory",
            )
            .at(12));
        }
        let mut env = Envelope {
            flags: u32_at(head, 8),
            required_features,
            sections: [Span::default(); 6],
            header_hash: u64_at(head, 0x70),
            dir_hash: u64_at(head, 0x78),
        };
        for s in Section::ALL {
            let at = s.envelope_offset();
            let span = Span::new(u64_at(head, at as usize), u64_at(head, at as usize + 8));
            let required = matches!(s, Section::Header | Section::Directory);
            if !span.is_present() {
                if required {
                    return Err(Fault::malformed(
                        s.len_field(),
                        format!("the {} section is required but its length is 0", s.name()),
                    )
                    .at(at + 8));
                }
                env.sections[s as usize] = Span::default();
                continue;
            }
            if span.off < ENVELOPE_LEN as u64 {
                return Err(Fault::malformed(
                    s.off_field(),
                    format!(
                        "{} section starts at byte {}, inside the 128-byte envelope",
                        s.name(),
                        span.off
                    ),
                )
                .at(at));
            }
            match span.off.checked_add(span.len) {
                Some(end) if end <= file_len && usize::try_from(end).is_ok() => {}
                _ => {
                    return Err(Fault::malformed(
                        s.len_field(),
                        format!(
                            "{} section [{}, +{}) runs past the end of the file ({file_len} bytes)",
                            s.name(),
                            span.off,
                            span.len
                        ),
                    )
                    .at(at + 8))
                }
            }
            env.sections[s as usize] = span;
        }
        // Sections are disjoint byte ranges; an overlap means an offset or length is corrupt.
        let present: Vec<(Section, Span)> = Section::ALL
            .into_iter()
            .map(|s| (s, env.section(s)))
            .filter(|(_, sp)| sp.is_present())
            .collect();
        for (i, &(a, sa)) in present.iter().enumerate() {
            for &(b, sb) in &present[i + 1..] {
                if sa.off < sb.end() && sb.off < sa.end() {
                    return Err(Fault::malformed(
                        b.len_field(),
                        format!(
                            "{} section [{}, +{}) overlaps the {} section [{}, +{})",
                            b.name(),
                            sb.off,
                            sb.len,
                            a.name(),
                            sa.off,
                            sa.len
                        ),
                    )
                    .at(b.envelope_offset() + 8));
                }
            }
        }
        let data = env.section(Section::Data);
        if data.is_present() && !data.off.is_multiple_of(DATA_ALIGN) {
            return Err(Fault::malformed(
                "data_off",
                format!(
                    "data section offset {} is not a multiple of {DATA_ALIGN}",
                    data.off
                ),
            )
            .at(Section::Data.envelope_offset()));
        }
        Ok(env)
    }

    pub fn encode(&self) -> [u8; ENVELOPE_LEN] {
        let mut b = [0u8; ENVELOPE_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.required_features.to_le_bytes());
        for s in Section::ALL {
            let at = s.envelope_offset() as usize;
            let span = self.section(s);
            // Offset 0 marks an absent section.
            let off = if span.is_present() { span.off } else { 0 };
            b[at..at + 8].copy_from_slice(&off.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&span.len.to_le_bytes());
        }
        b[0x70..0x78].copy_from_slice(&self.header_hash.to_le_bytes());
        b[0x78..0x80].copy_from_slice(&self.dir_hash.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Envelope {
        let mut e = Envelope {
            required_features: features::TENSOR_DIR,
            ..Default::default()
        };
        e.set_section(Section::Header, Span::new(128, 10));
        e.set_section(Section::Directory, Span::new(138, 16));
        e.set_section(Section::Data, Span::new(4096, 64));
        e
    }

    #[test]
    fn round_trip() {
        let e = sample();
        assert_eq!(Envelope::parse(&e.encode(), 4160).unwrap(), e);
    }

    #[test]
    fn refusals_name_the_field() {
        let good = sample().encode();
        let field = |b: &[u8], len: u64| Envelope::parse(b, len).unwrap_err().field;
        assert_eq!(field(&good[..100], 100), "envelope");
        let mut b = good;
        b[3] = 2;
        assert_eq!(field(&b, 4160), "magic");
        let mut b = good;
        b[4] = 1;
        assert_eq!(field(&b, 4160), "version");
        let mut b = good;
        b[12] |= 2;
        assert_eq!(field(&b, 4160), "required_features");
        assert_eq!(field(&good, 4159), "data_len");
        let mut e = sample();
        e.set_section(Section::Data, Span::new(4000, 64));
        assert_eq!(field(&e.encode(), 4160), "data_off");
        let mut e = sample();
        e.set_section(Section::Vocab, Span::new(u64::MAX, 2));
        assert_eq!(field(&e.encode(), 4160), "vocab_len");
        let mut e = sample();
        e.set_section(Section::Directory, Span::new(138, 0));
        assert_eq!(field(&e.encode(), 4160), "dir_len");
        let mut e = sample();
        e.set_section(Section::Vocab, Span::new(4100, 10));
        let f = Envelope::parse(&e.encode(), 4160).unwrap_err();
        assert_eq!(f.field, "vocab_len");
        assert!(f.message.contains("overlaps the data section"), "{f}");
        let mut e = sample();
        e.required_features = 0;
        assert_eq!(field(&e.encode(), 4160), "required_features");
    }
}
