"""The oracle of the conversation tests (tests/tests/chat.rs): a small byte-level BPE tokenizer
trained here with `tokenizers`, model directories with the test templates (tests/py/chat/), a
varied record set, and what transformers' apply_chat_template(..., tokenize=True,
return_dict=True, return_assistant_tokens_mask=True) makes of each record. No torch.

  chat_oracle.py make OUT_DIR    writes OUT_DIR/{qwen,qwen-markers,llama,llama-markers}/,
                                 OUT_DIR/records.jsonl, OUT_DIR/tools.jsonl (conversations
                                 with tools) and OUT_DIR/expected.json
  chat_oracle.py containers OUT_DIR   the records (as `messages`) as Parquet, an HF datasets
                                 directory, an Arrow IPC file and stream; a bad Parquet file;
                                 the tool records as Parquet and HF datasets (tools as JSON
                                 strings and as structs) and tools_expected.json
  chat_oracle.py dated OUT_DIR EPOCH   OUT_DIR/dated/, a model whose template writes the date
                                 with strftime_now, OUT_DIR/dated.jsonl and OUT_DIR/expected.json,
                                 transformers' clock set to EPOCH (seconds since 1970, UTC); and
                                 OUT_DIR/{mistral,mistral-markers}/, a Mistral-style template, and
                                 what transformers makes of the same records with it
  chat_oracle.py bench MODEL_DIR RECORDS.jsonl   times transformers on every record (the
                                 benchmark's Python side); prints conversations/s

Directories named *-markers hold the same template without its {% generation %} tags (hspipe
then finds the assistant turns by their markers); the expected masks come from the tagged one.
"""
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]

CORPUS = [
    "Hello there, how are you today?", "I am fine, thank you. And you?",
    "The capital of France is Paris.", "What is two plus two? It is four.",
    "Ça va très bien, merci beaucoup!", "日本語のテキストと中文的句子。", "Emoji 🙂 🎉 are text too.",
    "You are a helpful assistant.", "Think step by step before you answer.",
    "The weather is sunny with a light breeze.", "Tools return results as JSON objects.",
]

RECORDS = [
    {"messages": [{"role": "user", "content": "Hello there"},
                  {"role": "assistant", "content": "Hi! How can I help?"}]},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Japan?"},
                  {"role": "assistant", "content": "Tokyo."}], "id": 2},
    {"messages": [{"role": "user", "content": "Say nothing."},
                  {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "Ça va? 日本語のテキスト 🙂"},
                  {"role": "assistant", "content": "Très bien — merci! 🎉 中文"}]},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n\nIt is 4."}]},
    {"messages": [{"role": "user", "content": "Capital of Italy?"},
                  {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy's capital is Rome."}]},
    {"messages": [{"role": "user", "content": "First question"},
                  {"role": "assistant", "content": "<think>old thoughts</think>First answer"},
                  {"role": "user", "content": "Second question"},
                  {"role": "assistant", "content": "<think>new thoughts</think>Second answer"}]},
    {"conversations": [{"from": "system", "value": "Answer briefly."},
                       {"from": "human", "value": "Is the weather sunny?"},
                       {"from": "gpt", "value": "Yes, with a light breeze."},
                       {"from": "human", "value": "Thanks"},
                       {"from": "gpt", "value": "You are welcome."}]},
    {"messages": [{"role": "user", "content": "What does the tool say?"},
                  {"role": "assistant", "content": "Let me call it."},
                  {"role": "tool", "content": "{\"temp\": 21}"},
                  {"role": "assistant", "content": "It is 21 degrees."}]},
    # The arguments' keys out of sorted order: the template writes them with tojson, in the
    # record's order.
    {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"type": "function", "function": {
                       "name": "get_weather", "arguments": {"unit": "°C", "city": "Oslo"}}}]},
                  {"role": "tool", "name": "get_weather", "content": "rain, 4 °C"},
                  {"role": "assistant", "content": "It rains in Oslo."}]},
    {"messages": [{"role": "user", "content": "  spaced out  \n"},
                  {"role": "assistant", "content": "\n  trimmed or not  \n"}]},
    {"messages": [{"role": "system", "content": "No answer follows."},
                  {"role": "user", "content": "Anyone there?"}]},
]

# Function definitions, keys out of sorted order ("required" before "properties"), non-ASCII
# text: the templates write them with tojson, in the record's order.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Météo d'une ville 🌦",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"unit": {"type": "string", "enum": ["°C", "°F"]},
                                      "city": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}}}}},
]
CALL = [{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"unit": "°C", "city": "Oslo"}}}]},
        {"role": "tool", "name": "get_weather", "content": "rain, 4 °C"},
        {"role": "assistant", "content": "It rains in Oslo."}]
# Conversations with `tools` (apply_chat_template(messages, tools=tools)): a list; the same as a
# string of JSON (as HF datasets store them); with a system message; an empty list (Llama's
# template renders its tools block for it: it tests `tools is not none`); none.
TOOL_RECORDS = [
    {"messages": CALL, "tools": TOOLS},
    {"tools": json.dumps(TOOLS, ensure_ascii=False), "messages": CALL},
    {"messages": [{"role": "system", "content": "Use the tools."}] + CALL, "tools": TOOLS[1:]},
    {"messages": CALL[:2] + [{"role": "tool", "content": "4 °C"},
                             {"role": "assistant", "content": "4 °C."}], "tools": []},
    {"messages": [{"role": "user", "content": "Hello there"},
                  {"role": "assistant", "content": "Hi!"}]},
]
TOOL_OPTIONS = [("default", None), ("system", "You are terse.")]


def tools_of(record):
    """The tools transformers gets: a string of JSON parsed, as hspipe parses it."""
    t = record.get("tools")
    if isinstance(t, str):
        return json.loads(t) if t.strip() else None
    return t


# name -> (template file, tokenizer_config special tokens)
TEXT = "Plain text, trained whole: 日本語 🙂"
MODELS = {
    "qwen": ("qwen.jinja", {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama": ("llama.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}

# Option sets, as the Rust side names them: (name, enable_thinking, train_only_last_turn, system_prompt).
OPTIONS = {
    "qwen": [("default", None, False, None), ("thinking-off", False, False, None),
             ("thinking-on", True, False, None), ("last-turn", None, True, None),
             ("system", None, False, "You are terse.")],
    "llama": [("default", None, False, None), ("last-turn", None, True, None),
              ("system", None, False, "You are terse.")],
}


def tokenizer_json():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, min_frequency=1, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = CORPUS * 20 + [json.dumps(r, ensure_ascii=False) for r in RECORDS]
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def strip_generation(template):
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def messages_of(record):
    """The messages transformers gets: roles mapped from ShareGPT, as hspipe maps them."""
    if "messages" in record:
        return record["messages"]
    names = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": names[m["from"]], "content": m["value"]} for m in record["conversations"]]


def last_run(mask):
    """The mask with only its last run of ones kept (train_only_last_turn)."""
    out = [0] * len(mask)
    i = len(mask) - 1
    while i >= 0 and mask[i] == 0:
        i -= 1
    while i >= 0 and mask[i] == 1:
        out[i] = 1
        i -= 1
    return out


def write_model(out, name, template, specials, tok_json, in_config):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write(tok_json)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768, **specials}
    if in_config:
        config["chat_template"] = template
    else:
        with open(os.path.join(out, "chat_template.jinja"), "w") as f:
            f.write(template)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def tool_samples(tok, records, system=None):
    """What transformers makes of `records` with their tools (samples with a trained token)."""
    got = []
    for r in records:
        msgs = messages_of(r)
        if system is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": system}] + msgs
        o = tok.apply_chat_template(msgs, tools=tools_of(r), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        mask = list(o["assistant_masks"])
        if any(mask):
            got.append({"input_ids": list(o["input_ids"]), "loss_mask": mask})
    return got


def make(out):
    from transformers import AutoTokenizer

    tok_json = tokenizer_json()
    expected = {}
    for name, (file, specials) in MODELS.items():
        template = open(os.path.join(HERE, "chat", file)).read()
        write_model(os.path.join(out, name), name, template, specials, tok_json, False)
        # The markers copy keeps its template in tokenizer_config.json (the other place HF puts it).
        write_model(os.path.join(out, name + "-markers"), name, strip_generation(template),
                    specials, tok_json, name == "llama")
        tok = AutoTokenizer.from_pretrained(os.path.join(out, name))
        for opt, thinking, last, system in OPTIONS[name]:
            got = []
            for r in RECORDS:
                msgs = messages_of(r)
                if system is not None and msgs[0]["role"] != "system":
                    msgs = [{"role": "system", "content": system}] + msgs
                kw = {} if thinking is None else {"enable_thinking": thinking}
                o = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kw)
                mask = list(o["assistant_masks"])
                if last:
                    mask = last_run(mask)
                if any(mask):
                    got.append({"input_ids": list(o["input_ids"]), "loss_mask": mask})
            expected[f"{name}/{opt}"] = got
        for opt, system in TOOL_OPTIONS:
            expected[f"{name}/tools/{opt}"] = tool_samples(tok, TOOL_RECORDS, system)
        text = TEXT
        expected[f"{name}/text"] = [{"input_ids": tok(text, add_special_tokens=False)["input_ids"],
                                     "text": text}]
    with open(os.path.join(out, "records.jsonl"), "w") as f:
        for r in RECORDS:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(out, "tools.jsonl"), "w") as f:
        for r in TOOL_RECORDS:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)


def dated(out, epoch):
    """A model whose template dates its system prompt with strftime_now (chat/dated.jinja),
    the records it takes, and what transformers makes of them with its clock at `epoch` (in
    UTC, as hspipe's data.template_date is): transformers' strftime_now reads datetime.now()."""
    from datetime import datetime, timezone

    import transformers.utils.chat_template_utils as ctu
    from transformers import AutoTokenizer

    at = datetime.fromtimestamp(int(epoch), timezone.utc)

    class Fixed(datetime):
        @classmethod
        def now(cls, tz=None):
            return at.replace(tzinfo=None)

    ctu.datetime = Fixed
    template = open(os.path.join(HERE, "chat", "dated.jinja")).read()
    specials = MODELS["llama"][1]
    write_model(os.path.join(out, "dated"), "dated", template, specials, tokenizer_json(), False)
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "dated"))
    records = RECORDS[:4]
    got = []
    for r in records:
        o = tok.apply_chat_template(messages_of(r), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        got.append({"input_ids": list(o["input_ids"]), "loss_mask": list(o["assistant_masks"])})
    with open(os.path.join(out, "dated.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    text = tok.apply_chat_template(messages_of(records[0]), tokenize=False)
    expected = {"dated": got, "dated_text": text}
    # A Mistral-style template (user turns not closed as assistant turns are): tagged, and a
    # copy without its tags, whose turns hspipe finds by markers.
    template = open(os.path.join(HERE, "chat", "mistral.jinja")).read()
    write_model(os.path.join(out, "mistral"), "mistral", template, specials, tokenizer_json(), False)
    write_model(os.path.join(out, "mistral-markers"), "mistral", strip_generation(template),
                specials, tokenizer_json(), False)
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "mistral"))
    expected["mistral"] = []
    for r in records:
        o = tok.apply_chat_template(messages_of(r), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        expected["mistral"].append({"input_ids": list(o["input_ids"]),
                                    "loss_mask": list(o["assistant_masks"])})
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)


def containers(out):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [[dict(m) for m in messages_of(r)] for r in RECORDS]
    t = pa.table({"id": pa.array(range(len(rows))), "messages": rows})
    pq.write_table(t, os.path.join(out, "chats.parquet"))
    with pa.OSFile(os.path.join(out, "chats.arrow"), "wb") as f:
        with pa.ipc.new_file(f, t.schema) as w:
            w.write_table(t)
    with pa.OSFile(os.path.join(out, "chats.arrows"), "wb") as f:
        with pa.ipc.new_stream(f, t.schema) as w:
            w.write_table(t)
    datasets.Dataset(t).save_to_disk(os.path.join(out, "chats_hf"), num_shards=2)
    # pandas' categorical: a dictionary-encoded `text` column (read back as one by arrow).
    import pandas as pd
    texts = pd.DataFrame({"text": pd.Categorical([TEXT, TEXT])})
    pq.write_table(pa.Table.from_pandas(texts, preserve_index=False),
                   os.path.join(out, "texts_categorical.parquet"))
    bad = rows[:2] + [[{"role": "robot", "content": "beep"}]] + rows[2:]
    pq.write_table(pa.table({"messages": bad}), os.path.join(out, "bad_role.parquet"))
    tool_containers(out)


def tool_containers(out):
    """TOOL_RECORDS as Parquet with `tools` a column of JSON strings and one of structs (what
    pyarrow makes of the dicts: every tool gets every field any tool has, None where it has
    none), and the structs as an HF datasets directory; tools_expected.json: what transformers
    makes of each file's rows as pyarrow reads them back, keyed by file name."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    messages = [[dict(m) for m in messages_of(r)] for r in TOOL_RECORDS]
    strings = [None if tools_of(r) is None else json.dumps(tools_of(r), ensure_ascii=False)
               for r in TOOL_RECORDS]
    structs = [tools_of(r) for r in TOOL_RECORDS]
    t = pa.table({"messages": messages, "tools": strings})
    pq.write_table(t, os.path.join(out, "tools_strings.parquet"))
    t = pa.table({"messages": messages, "tools": structs})
    pq.write_table(t, os.path.join(out, "tools_structs.parquet"))
    datasets.Dataset(t).save_to_disk(os.path.join(out, "tools_structs_hf"), num_shards=2)
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "qwen"))
    expected = {}
    for name in ["tools_strings.parquet", "tools_structs.parquet"]:
        rows = pq.read_table(os.path.join(out, name)).to_pylist()
        expected[name] = tool_samples(tok, rows)
    rows = list(datasets.load_from_disk(os.path.join(out, "tools_structs_hf")))
    expected["tools_structs_hf"] = tool_samples(tok, rows)
    with open(os.path.join(out, "tools_expected.json"), "w") as f:
        json.dump(expected, f)


def bench(model, records):
    import time

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(l) for l in open(records) if l.strip()]
    t = time.perf_counter()
    n = 0
    for r in rows:
        tok.apply_chat_template(messages_of(r), tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
        n += 1
    dt = time.perf_counter() - t
    print(json.dumps({"conversations": n, "seconds": dt, "per_s": n / dt}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2])
    elif cmd == "containers":
        containers(sys.argv[2])
    elif cmd == "dated":
        dated(sys.argv[2], sys.argv[3])
    elif cmd == "bench":
        bench(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")
