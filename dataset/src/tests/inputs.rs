//! Inputs that cannot be read: each is an error that says what is wrong with it, never a
//! panic.

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, DictionaryArray, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Fields};

use super::Dir;
use crate::{DataError, Kind, Writer};

/// Converts `path` as `kind` without a tokenizer (a conversation or text is an error, once its
/// record batch is decoded).
fn convert(path: &Path, kind: &Kind) -> Result<(), DataError> {
    let mut w = Writer::new(std::io::sink(), Vec::new()).unwrap();
    let maker = crate::records::Maker {
        max_len: 512,
        too_long: crate::TooLong::Drop,
        chat: None,
        no_tokenizer_in: None,
    };
    crate::convert::convert(
        path,
        kind,
        &maker,
        &mut w,
        &mut |_| std::ops::ControlFlow::Continue(()),
        &mut |_| {},
    )
    .map(|_| ())
}

/// An Arrow file of one record batch with `columns`.
fn arrow_file(columns: Vec<(&str, ArrayRef)>) -> Vec<u8> {
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let mut out = Vec::new();
    let mut w = arrow_ipc::writer::FileWriter::try_new(&mut out, &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    drop(w);
    out
}

/// Which buffer a damaged file's metadata lengthens: buffer `k` of its first record batch, or of
/// its first dictionary.
#[derive(Clone, Copy, Debug)]
enum Buffer {
    Batch(usize),
    Dictionary(usize),
}

/// `file` with the length of `buffer` one byte longer, in its message's metadata (the body is
/// left as it is: the buffer's padding takes the byte). Long enough for its values, arrow takes
/// it, and reads its offsets as a slice of whole ones.
fn lengthen_buffer(file: &[u8], buffer: Buffer) -> Vec<u8> {
    let footer =
        arrow_ipc::root_as_footer(&file[file.len() - 10 - footer_len(file)..file.len() - 10])
            .unwrap();
    let (blocks, k) = match buffer {
        Buffer::Batch(k) => (footer.recordBatches(), k),
        Buffer::Dictionary(k) => (footer.dictionaries(), k),
    };
    let block = blocks.unwrap().get(0);
    let meta =
        block.offset() as usize..(block.offset() + i64::from(block.metaDataLength())) as usize;
    let msg = arrow_ipc::root_as_message(&file[meta.start + 8..meta.end]).unwrap();
    let rb = match buffer {
        Buffer::Batch(_) => msg.header_as_record_batch(),
        Buffer::Dictionary(_) => msg.header_as_dictionary_batch().unwrap().data(),
    };
    let b = rb.unwrap().buffers().unwrap().get(k);
    assert!(b.length() > 0, "buffer {k} is empty");
    assert!(
        (b.offset() + b.length()) % 8 != 0,
        "buffer {k} has no padding"
    );
    // The buffer's (offset, length) pair, as the metadata holds it: once, since it is the only
    // non-empty buffer at that offset.
    let pair: Vec<u8> = [b.offset(), b.length()]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let at: Vec<usize> = (meta.start..meta.end - 16)
        .filter(|&i| file[i..i + 16] == pair[..])
        .collect();
    assert_eq!(at.len(), 1, "buffer {k}'s entry is not found once");
    let mut out = file.to_vec();
    out[at[0] + 8..at[0] + 16].copy_from_slice(&(b.length() + 1).to_le_bytes());
    out
}

fn footer_len(file: &[u8]) -> usize {
    let n = file.len();
    i32::from_le_bytes(file[n - 10..n - 6].try_into().unwrap()) as usize
}

/// Where an Arrow file's stream starts (see `stream_start` in the parent module).
fn stream_of(file: &[u8]) -> &[u8] {
    &file[super::stream_start(file)..]
}

#[test]
fn a_string_offsets_buffer_of_a_damaged_length_is_an_error_at_any_depth() {
    let d = Dir::new("string-offsets");
    // A `text` column: buffers validity (0), offsets (1), values (2).
    let text: ArrayRef = Arc::new(StringArray::from(vec!["hello there", "how are you"]));
    // A `messages` column, list<struct<role, content>>: list validity (0), list offsets (1),
    // struct validity (2), role validity, offsets, values (3, 4, 5), content's (6, 7, 8).
    let fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ]);
    let mut messages = ListBuilder::new(StructBuilder::from_fields(fields, 2));
    for (role, content) in [("user", "hi"), ("assistant", "hello")] {
        let s = messages.values();
        s.field_builder::<StringBuilder>(0)
            .unwrap()
            .append_value(role);
        s.field_builder::<StringBuilder>(1)
            .unwrap()
            .append_value(content);
        s.append(true);
    }
    messages.append(true);
    let messages: ArrayRef = Arc::new(messages.finish());
    // A dictionary-encoded `text`: its dictionary's buffers are its values' (validity,
    // offsets, values).
    let categorical: DictionaryArray<Int32Type> =
        ["hello there", "how are you"].into_iter().collect();
    for (column, array, buffer) in [
        ("text", text.clone(), Buffer::Batch(1)),
        ("messages", messages.clone(), Buffer::Batch(4)),
        ("messages", messages, Buffer::Batch(7)),
        ("text", Arc::new(categorical), Buffer::Dictionary(1)),
    ] {
        let (Buffer::Batch(k) | Buffer::Dictionary(k)) = buffer;
        let file = arrow_file(vec![(column, array)]);
        let damaged = lengthen_buffer(&file, buffer);
        for (name, bytes, kind) in [
            ("x.arrow", &file[..], Kind::ArrowFile { prepared: false }),
            ("x.arrows", stream_of(&file), Kind::ArrowStream),
            (
                "bad.arrow",
                &damaged[..],
                Kind::ArrowFile { prepared: false },
            ),
            ("bad.arrows", stream_of(&damaged), Kind::ArrowStream),
        ] {
            let p = d.file(name, bytes);
            let e = convert(&p, &kind).unwrap_err().to_string();
            if name.starts_with("bad") {
                let want = format!("buffer {k} holds");
                assert!(
                    e.contains(&want) && e.contains("4-byte string offsets"),
                    "{column}: {e}"
                );
                assert!(e.contains(name), "{e}");
            } else {
                // Intact, it is decoded; only the missing tokenizer stops it.
                assert!(e.contains("no tokenizer was loaded"), "{column}: {e}");
            }
        }
    }
}

/// Prepares a JSONL file of `bytes`: its samples, or the error.
fn jsonl_bytes(name: &str, bytes: &[u8]) -> Result<Vec<super::Owned>, DataError> {
    let d = Dir::new("jsonl-bytes");
    let input = d.file(name, bytes);
    let p = crate::prepare(&input, 8, &d.0.join("cache"), None, &mut crate::quiet)?;
    Ok(super::read_all(&crate::Mapped::open(&p.path).unwrap()))
}

#[test]
fn a_jsonl_line_that_is_not_utf8_is_named() {
    let e = jsonl_bytes(
        "train.jsonl",
        b"{\"input_ids\": [1,2,3]}\n{\"input_ids\": [4,5,\xff6]}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("train.jsonl:2: not UTF-8 text: byte 0xff at column 20"),
        "{e}"
    );
}

#[test]
fn a_utf8_byte_order_mark_before_the_first_line_is_skipped() {
    let got = jsonl_bytes(
        "bom.jsonl",
        "\u{feff}{\"input_ids\": [1,2,3]}\n{\"input_ids\": [4]}\n".as_bytes(),
    )
    .unwrap();
    assert_eq!(got, vec![(vec![1, 2, 3], None), (vec![4], None)]);
    // Only the first line may start with one: elsewhere it is text that is not JSON.
    let e = jsonl_bytes(
        "bom2.jsonl",
        "{\"input_ids\": [1]}\n\u{feff}{\"input_ids\": [4]}\n".as_bytes(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("bom2.jsonl:2: not a sample: the line starts with a UTF-8 byte order mark"),
        "{e}"
    );
}

#[test]
fn a_compressed_file_is_named_as_such_with_how_to_decompress_it() {
    // `{"input_ids":[1,2,3]}\n` compressed by Python's gzip module.
    const GZ: [u8; 42] = [
        0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0x56, 0xca, 0xcc, 0x2b,
        0x28, 0x2d, 0x89, 0xcf, 0x4c, 0x29, 0x56, 0xb2, 0x8a, 0x36, 0xd4, 0x31, 0xd2, 0x31, 0x8e,
        0xad, 0xe5, 0x02, 0x00, 0xcd, 0x12, 0x31, 0x0e, 0x16, 0x00, 0x00, 0x00,
    ];
    for name in ["train.jsonl.gz", "train.jsonl"] {
        let e = jsonl_bytes(name, &GZ).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains("it is gzip-compressed: decompress it first (gunzip"),
            "{e}"
        );
    }
    let e = jsonl_bytes("train.jsonl.zst", &[0x28, 0xb5, 0x2f, 0xfd, 0, 0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("it is zstd-compressed"), "{e}");
}

#[test]
fn a_json_array_is_named_as_one_rather_than_read_as_lines() {
    for text in [
        "[{\"input_ids\": [1,2,3]}]\n",
        "\n  [\n  {\"input_ids\": [1,2,3]},\n  {\"input_ids\": [4]}\n]\n",
    ] {
        let e = jsonl_bytes("train.json", text.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.json: it holds a JSON array, not JSON Lines (one object per line)"),
            "{e}"
        );
    }
    // A later line that is no object says what it is.
    let e = jsonl_bytes("train.jsonl", b"{\"input_ids\": [1]}\n[1, 2]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.jsonl:2: not a sample: the line is a list, not a JSON object"),
        "{e}"
    );
}

/// A named pipe (or a device, or `<(...)`, a pipe) is refused by what it is, before it is
/// opened: an open of a FIFO without a writer blocks for ever, and the input is read twice
/// (hashed, then converted), which a pipe cannot give.
#[test]
fn a_fifo_or_device_is_refused_without_opening_it() {
    let e = testkit::fifo_refusal("train.jsonl", |d| {
        (crate::convert::detect(&d.join("train.jsonl")).err()).map(|e| e.to_string())
    });
    assert!(
        e.contains("train.jsonl") && e.contains("not a regular file") && e.contains("FIFO"),
        "{e}"
    );
    // A shard of an HF directory too (it hung opening it to hash).
    let e = testkit::fifo_refusal("data-00000-of-00001.arrow", |d| {
        (crate::convert::detect(d).err()).map(|e| e.to_string())
    });
    assert!(
        e.contains("data-00000-of-00001.arrow") && e.contains("not a regular file"),
        "{e}"
    );
    let e = crate::convert::detect(Path::new("/dev/null"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/dev/null") && e.contains("not a regular file"),
        "{e}"
    );
}
