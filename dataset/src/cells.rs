//! An Arrow cell as JSON, so a conversation column (lists of structs of strings, as pyarrow and
//! HF `datasets` write them, a string column dictionary-encoded or not) is checked by the same
//! record parser as a JSONL line.

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::Array;
use arrow_schema::DataType;
use serde_json::Value as J;

use crate::arrow_io::type_name;

/// The value of `a` at `i`: strings, numbers, booleans, lists and structs; `Err` names a type
/// that is not read.
pub fn json_of(a: &dyn Array, i: usize) -> Result<J, String> {
    if a.is_null(i) {
        return Ok(J::Null);
    }
    let list = |v: std::sync::Arc<dyn Array>| -> Result<J, String> {
        (0..v.len())
            .map(|j| json_of(v.as_ref(), j))
            .collect::<Result<_, _>>()
            .map(J::Array)
    };
    let float = |x: f64| serde_json::Number::from_f64(x).map_or(J::Null, J::Number);
    Ok(match a.data_type() {
        // pyarrow's type of a field that is None in every row (a tool's `"default": null`):
        // arrow's `NullArray` has no validity buffer, so `is_null` above says false.
        DataType::Null => J::Null,
        DataType::Utf8 => J::from(a.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => J::from(a.as_string::<i64>().value(i)),
        DataType::Utf8View => J::from(a.as_string_view().value(i)),
        DataType::Boolean => J::Bool(a.as_boolean().value(i)),
        DataType::Int8 => J::from(a.as_primitive::<Int8Type>().value(i)),
        DataType::Int16 => J::from(a.as_primitive::<Int16Type>().value(i)),
        DataType::Int32 => J::from(a.as_primitive::<Int32Type>().value(i)),
        DataType::Int64 => J::from(a.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => J::from(a.as_primitive::<UInt8Type>().value(i)),
        DataType::UInt16 => J::from(a.as_primitive::<UInt16Type>().value(i)),
        DataType::UInt32 => J::from(a.as_primitive::<UInt32Type>().value(i)),
        DataType::UInt64 => J::from(a.as_primitive::<UInt64Type>().value(i)),
        DataType::Float32 => float(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(i)),
        DataType::List(_) => list(a.as_list::<i32>().value(i))?,
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i))?,
        // pandas' categoricals and pyarrow's `dictionary_encode`: a key into the values.
        DataType::Dictionary(..) => {
            let d = a.as_any_dictionary();
            let n = d.values().len();
            let k = json_of(d.keys(), i)?;
            // arrow's readers check the keys; a key outside is an error here, never a panic.
            let Some(at) = k
                .as_u64()
                .and_then(|k| usize::try_from(k).ok())
                .filter(|&k| k < n)
            else {
                return Err(format!("holds dictionary key {k}, outside its {n} values"));
            };
            json_of(d.values().as_ref(), at)?
        }
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut m = serde_json::Map::new();
            for (f, c) in fields.iter().zip(s.columns()) {
                m.insert(f.name().clone(), json_of(c.as_ref(), i)?);
            }
            J::Object(m)
        }
        t => return Err(format!("holds {}, which is not read", type_name(t))),
    })
}
