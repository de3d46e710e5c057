#!/usr/bin/env python3
"""Reference token ids for lily's tokenizer tests, from the Hugging Face `tokenizers` library.

Writes tests/fixtures/tokenizer/corpus.jsonl: one JSON object per line,
  {"kind": ..., "text": ..., "ids": [...], "ids_qwen36": [...]}            (valid UTF-8 input)
  {"kind": "invalid_utf8", "bytes_hex": ..., "text": ..., "ids": [...], ...} (invalid UTF-8 input)
`ids` come from tests/fixtures/qwen3-tokenizer/tokenizer.json; `ids_qwen36` from the same file with its
Split regex replaced by the Qwen3.6 regex of docs/MODEL.md section 3 (QWEN36_REGEX below; the C++
test applies the same substitution at load, so no second 11 MB tokenizer.json is committed).

Invalid UTF-8: `tokenizers` only takes Python str, so for those cases `text` is
bytes.decode("utf-8", "replace") (each maximal invalid subpart -> one U+FFFD) and the ids are those of
that text; lily's Tokenizer::encode applies the same replacement to raw bytes, so the C++ test feeds
bytes_hex and expects these ids.

Also writes tests/fixtures/tokenizer/synthetic.json: a tiny tokenizer.json exercising the added-token
flags that Qwen's tokens leave off (lstrip, rstrip, single_word, normalized), with reference ids.

The corpus is generated deterministically (fixed seeds, no external data). Also prints the one-thread
encode throughput of `tokenizers` on the corpus (Tokenizer.encode per line, not encode_batch).

Usage: RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python3 tools/reference/tokenizer_ids.py
"""
import json
import os
import random
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from tokenizers import Tokenizer  # noqa: E402  (after the env vars, which the library reads at load)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
TOKENIZER_JSON = os.path.join(FIXTURES, "qwen3-tokenizer", "tokenizer.json")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "corpus.jsonl")
SYNTHETIC_OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "synthetic.json")

# docs/MODEL.md section 3: the Qwen3.5/3.6 pre-tokenizer regex (adds the \p{M} mark class).
QWEN36_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ----------------------------------------------------------------------------------------------------
# Corpus fragments
# ----------------------------------------------------------------------------------------------------
WORDS = ("the of and to in is that it was for on are as with his they at be this from have or by one had "
         "not but what all were when we there can an your which their said if do will each about how up out "
         "them then she many some so these would other into has more her two like him see time could no make "
         "than first been its who now people my made over did down only way find use may water long little "
         "very after words called just where most know get through back much before go good new write our "
         "used me man too any day same right look think also around another came come work three word must "
         "because does part even place well such here take why things help put years different away again off "
         "went old number great tell men say small every found still between name should home big give air line "
         "set own under read last never us left end along while might next sound below saw something thought "
         "both few those always looked show large often together asked house don't world going want school "
         "important until form food keep children feet land side without boy once animals life enough took "
         "sometimes four head above kind began almost live page got earth need far hand high year mother light "
         "parts country father let night following picture being study second eyes soon times story boys since "
         "white days ever paper hard near sentence better best across during today others however sure means "
         "knew it's try told young miles sun ways thing whole hear example heard several change answer room sea "
         "against top turned learn point city play toward five using himself usually tokenizer transformer "
         "inference quantization attention embedding gradient kernel throughput latency").split()
CONTRACTIONS = ["it's", "don't", "we're", "they've", "I'm", "you'll", "she'd", "IT'S", "DON'T", "We'Re",
                "THEY'VE", "I'M", "YOU'LL", "SHE'D", "o'clock", "rock'n'roll", "'tis", "y'all", "ma'am",
                "it\u2019s", "don\u2019t", "'S", "'s'", "''", "'''", "Kelvin'K", "'\u017f", "'\u212a"]
PUNCT = [".", ",", "!", "?", ";", ":", "...", " -", " \u2014", "\u2026", " (", ")", "\"", "'", " [", "]"]

CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <vector>\n#include <string>\n\nint main(int argc, char** argv) {\n  return 0;\n}\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum = ${add(1, 2)}`);\n",
    "func main() {\n\tfmt.Println(\"hello, \u4e16\u754c\")\n}\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "if [ -z \"$HOME\" ]; then\n  echo 'no home' >&2; exit 1\nfi\n",
    "<div class=\"row\"><span id='x'>&nbsp;&lt;tag&gt;</span></div>\r\n",
    "{\"name\": \"lily\", \"version\": [0, 1, 2], \"ok\": true, \"ptr\": null}",
    "template <typename T>\nstruct Foo : public Bar<T> {\n  static constexpr int kSize = 128;\n};\n",
    "x = [i**2 for i in range(100) if i % 3 == 0]  # squares\n",
    "    @property\n    def shape(self):\n        return self._shape\n",
    "public static void Main(string[] args) { Console.WriteLine(\"Hi\"); }",
    "let rec fact n = if n <= 1 then 1 else n * fact (n - 1);;",
    "__global__ void k(float* __restrict__ y, const float* x) { y[threadIdx.x] = x[threadIdx.x]; }",
    "a->b->c; a::b::c; a<<=2; b>>=3; c!==d; e===f; g//=h; i**=j; k:=l; m?.n ?? o;",
    "\t\t\treturn nullptr;\r\n\t\t}\r\n\t}\r\n",
    "// TODO(#42): handle the \u00e9dge case\n/* multi\n   line */\n",
    "regex = r\"(?i:'s|'t)|[^\\r\\n\\p{L}]?\\p{L}+\"",
    "    \n    \n\n        x += 1\n",
    "print(\"\u3053\u3093\u306b\u3061\u306f\", end=\"\")",
    "git commit -m \"fix: tokenizer\" && git push origin main --force-with-lease",
    "$ ./lily tokenize --tokenizer tokenizer.json < input.txt > ids.json",
    "#!/usr/bin/env bash\nset -euo pipefail\nIFS=$'\\n\\t'\n",
    "matrix = [[1, 2, 3],\n          [4, 5, 6]]",
    "case 0x7f: case 0xFF: case 0b1010: return 1e-9 + 3.14f - .5;",
]

CJK = [
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002",
    "\u673a\u5668\u5b66\u4e60\u662f\u4eba\u5de5\u667a\u80fd\u7684\u4e00\u4e2a\u5206\u652f\u3002",
    "\u5927\u8bed\u8a00\u6a21\u578b\uff08LLM\uff09\u7684\u63a8\u7406\u901f\u5ea6\u53d6\u51b3\u4e8e\u5185\u5b58\u5e26\u5bbd\u3002",
    "\u6771\u4eac\u90fd\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002",
    "\u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\uff01\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3002",
    "\u30c8\u30fc\u30af\u30ca\u30a4\u30b6\u30fc\u306e\u30c6\u30b9\u30c8\u3092\u66f8\u304d\u307e\u3057\u305f\u3002",
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc744 \ud1a0\ud070\ud654\ud569\ub2c8\ub2e4. \uc548\ub155\ud558\uc138\uc694!",
    "\u5b57\u8282\u5bf9\u7f16\u7801\u628a\u6587\u672c\u5207\u6210\u5b50\u8bcd\uff1a\u300c\u4f60\u597d\u300d\u3001\u300e\u518d\u89c1\u300f\u3002",
    "\uff21\uff22\uff23\uff11\uff12\uff13\u3000\u5168\u89d2\u6587\u5b57\u3068\u534a\u89d2\uff76\uff80\uff76\uff85",
    "\u7e41\u9ad4\u4e2d\u6587\uff1a\u8cc7\u8a0a\u79d1\u6280\u767c\u5c55\u8fc5\u901f\u3002",
    "\U00020000\U0002a6d6\U0002b740 \u3400\u4dbf \uf900\ufa6d",
    "\u3131\u314f \u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af",
]

SCRIPTS = [
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0647\u0630\u0627 \u0627\u062e\u062a\u0628\u0627\u0631.",
    "\u0627\u0644\u0644\u064f\u0651\u063a\u064e\u0629\u064f \u0627\u0644\u0652\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u064e\u0651\u0629\u064f \u0661\u0662\u0663",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd, \u05d6\u05d4 \u05de\u05d1\u05d7\u05df.",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e\u0964 \u092f\u0939 \u090f\u0915 \u092a\u0930\u0940\u0915\u094d\u0937\u0923 \u0939\u0948\u0964",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092e\u0947\u0902 \u0915\u093f\u0924\u093e\u092c\u0947\u0902 \u0915\u094d\u0937 \u0924\u094d\u0930 \u091c\u094d\u091e \u0967\u0968\u0969",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e44\u0e21\u0e48\u0e21\u0e35\u0e0a\u0e48\u0e2d\u0e07\u0e27\u0e48\u0e32\u0e07",
    "\u09ac\u09be\u0982\u09b2\u09be \u09ad\u09be\u09b7\u09be\u09af\u09bc \u09b2\u09c7\u0996\u09be\u0964",
    "\u0ba4\u0bae\u0bbf\u0bb4\u0bcd \u0bae\u0bca\u0bb4\u0bbf \u0b85\u0bb4\u0b95\u0bbe\u0ba9\u0ba4\u0bc1.",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u042d\u0442\u043e \u0442\u0435\u0441\u0442 \u0442\u043e\u043a\u0435\u043d\u0438\u0437\u0430\u0442\u043e\u0440\u0430.",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5 \u2014 \u1f00\u03c1\u03c7\u03ae",
    "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0 \u0532\u0561\u0580\u0565\u0582 \u12a0\u121b\u122d\u129b",
    "Vi\u1ec7t Nam \u0111\u1eb9p l\u1eafm; ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u.",
    "\u0cae\u0cc8\u0cb8\u0cc2\u0cb0\u0cc1 \u0d2e\u0d32\u0d2f\u0d3e\u0d33\u0d02 \u0a2a\u0a70\u0a1c\u0a3e\u0a2c\u0a40 \u0a97\u0ac1\u0a9c\u0ab0\u0abe\u0aa4\u0ac0",
    "\u1019\u103c\u1014\u103a\u1019\u102c \u179f\u17bd\u179f\u17d2\u178f\u17b8 \u0f56\u0f7c\u0f51\u0f0b\u0f61\u0f72\u0f42",
    "\u0627\u0631\u062f\u0648 \u0632\u0628\u0627\u0646 \u06f1\u06f2\u06f3 \u0641\u0627\u0631\u0633\u06cc \u06a9\u062a\u0627\u0628",
]

EMOJI = [
    "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f3f3\ufe0f\u200d\U0001f308", "\U0001f1fa\U0001f1f8", "\U0001f1ef\U0001f1f5", "#\ufe0f\u20e3",
    "1\ufe0f\u20e3", "\u2764\ufe0f", "\U0001f9d1\U0001f3fb\u200d\U0001f4bb", "\U0001f415\u200d\U0001f9ba",
    "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f", "\u263a", "\u2728",
    "\U0001f680", "\U0001f92f", "\U0001fae0", "\U0001f468\U0001f3ff\u200d\U0001f91d\u200d\U0001f468\U0001f3fb",
    "\u00a9\ufe0f", "\u2122", "\U0001f4a9", "\U0001f525\U0001f525\U0001f525",
]

COMBINING = ["\u0301", "\u0300", "\u0302", "\u0303", "\u0308", "\u0327", "\u030a", "\u0323", "\u0331",
             "\u20dd", "\u0489", "\u1dc0", "\ufe20", "\u0336", "\u034f", "\u0670", "\u093c", "\u0e31"]
NFC_WORDS = ["caf\u00e9", "na\u00efve", "r\u00e9sum\u00e9", "\u00c5ngstr\u00f6m", "Stra\u00dfe", "fa\u00e7ade",
             "Ph\u1edf", "Nguy\u1ec5n", "\u1e9b\u0323", "\u00f1and\u00fa", "\u01d7", "\u1e69", "\ud55c\uae00",
             "\u00c7a va", "Z\u00fcrich", "\u0121\u0127", "\u212b", "\u2126", "\u0958", "\u0f43"]

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>", "<|vision_start|>", "<|image_pad|>",
            "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|file_sep|>", "<|box_start|>"]
NEAR_SPECIALS = ["<|im_start", "im_end|>", "<thinking>", "<think", "think>", "< think>", "<|im_start |>",
                 "<<think>>", "</think", "<|IM_START|>", "<THINK>", "<tool_call", "<|endoftext||>", "<|>"]

WHITESPACE = [" ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n",
              "\r", " \n", "\n ", " \t ", "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\u200b",
              "\u180e", "\u2003", "\u202f", "\u205f", "\u000b", "\u000c", " \r\n ", "\t\n\t"]

SAFE_RANGES = [(0x20, 0x7e), (0xa1, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x5f4), (0x600, 0x6ff),
               (0x900, 0x97f), (0xe00, 0xe5b), (0x1100, 0x11ff), (0x1e00, 0x1fff), (0x2000, 0x206f),
               (0x2190, 0x23ff), (0x2460, 0x24ff), (0x2500, 0x27bf), (0x3000, 0x30ff), (0x4e00, 0x9fff),
               (0xac00, 0xd7a3), (0xff01, 0xff9f), (0x1f300, 0x1f64f), (0x0300, 0x036f), (0x20d0, 0x20f0)]


def words(rng, n):
    return [rng.choice(WORDS) for _ in range(n)]


def gen_prose(rng):
    out = []
    for _ in range(rng.randint(1, 3)):
        w = words(rng, rng.randint(3, 18))
        if rng.random() < 0.5:
            w.insert(rng.randrange(len(w)), rng.choice(CONTRACTIONS))
        if rng.random() < 0.3:
            w[0] = w[0].capitalize() if rng.random() < 0.7 else w[0].upper()
        s = " ".join(w)
        if rng.random() < 0.4:
            i = rng.randrange(len(s))
            s = s[:i] + rng.choice(PUNCT) + s[i:]
        out.append(s + rng.choice([".", "!", "?", "", ":", ";", " ..."]))
    return " ".join(out)


def gen_code(rng):
    parts = rng.sample(CODE, rng.randint(1, 2))
    s = "".join(parts)
    if rng.random() < 0.3:
        s = s.replace("    ", "\t")
    if rng.random() < 0.2:
        s = s.replace("\n", "\r\n")
    return s


def gen_cjk(rng):
    parts = rng.sample(CJK, rng.randint(1, 3))
    sep = rng.choice(["", " ", "\n", " and ", "\u3002"])
    return sep.join(parts)


def gen_scripts(rng):
    parts = rng.sample(SCRIPTS, rng.randint(1, 2))
    if rng.random() < 0.3:
        parts.append(" ".join(words(rng, 4)))
    return rng.choice([" ", "\n", ", "]).join(parts)


def gen_emoji(rng):
    out = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.5:
            out.append(rng.choice(EMOJI))
        elif r < 0.8:
            out.append(rng.choice(WORDS))
        else:
            out.append(rng.choice([" ", "", "!", "\n", "  "]))
    return rng.choice(["", " "]).join(out)


def nfd(s):
    import unicodedata
    return unicodedata.normalize("NFD", s)


def gen_combining(rng):
    r = rng.random()
    if r < 0.35:  # decomposed (NFD) text: must normalize back to NFC
        return nfd(" ".join(rng.choice(NFC_WORDS) for _ in range(rng.randint(1, 6))))
    if r < 0.55:  # marks after letters, digits, spaces and punctuation; marks at the start
        base = rng.choice(["a", "1", " ", ".", "\n", "", "\u4e2d", "\u0915", "!", "Z"])
        return base + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 4))) + rng.choice(["", "x", " y"])
    if r < 0.7:  # zalgo
        s = rng.choice(WORDS)
        return "".join(c + "".join(rng.choice(COMBINING[:10]) for _ in range(rng.randint(0, 3))) for c in s)
    if r < 0.85:
        return " ".join(rng.choice(NFC_WORDS) for _ in range(rng.randint(1, 6)))
    return nfd(rng.choice(SCRIPTS))


def gen_numbers(rng):
    choices = [
        lambda: str(rng.randint(0, 10 ** rng.randint(1, 40))),
        lambda: f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 9)}f}",
        lambda: f"{rng.random():e}",
        lambda: "+1 (555) %03d-%04d" % (rng.randint(0, 999), rng.randint(0, 9999)),
        lambda: "%d,%03d,%03d" % (rng.randint(1, 999), rng.randint(0, 999), rng.randint(0, 999)),
        lambda: "v%d.%d.%d-rc%d" % tuple(rng.randint(0, 20) for _ in range(4)),
        lambda: "2024-%02d-%02dT%02d:%02d:%02dZ" % (rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23),
                                                    rng.randint(0, 59), rng.randint(0, 59)),
        lambda: "0x%x 0b%s" % (rng.getrandbits(64), bin(rng.getrandbits(20))[2:]),
        lambda: "\u0661\u0662\u0663\u0664 \uff11\uff12\uff13 \u00b2\u00b3 \u00bd\u00be \u2160\u216b \u0967\u0968 \u2460\u2461",
        lambda: "".join(rng.choice("0123456789") for _ in range(rng.randint(50, 300))),
        lambda: "The answer is %d%% of %d items (%d\u00b0C)." % (rng.randint(0, 100), rng.randint(1, 9999),
                                                               rng.randint(-40, 50)),
        lambda: "$%d.%02d \u20ac%d \u00a5%d \u00a3%d" % (rng.randint(0, 9999), rng.randint(0, 99), rng.randint(0, 999),
                                                      rng.randint(0, 99999), rng.randint(0, 99)),
    ]
    return " ".join(rng.choice(choices)() for _ in range(rng.randint(1, 3)))


def gen_whitespace(rng):
    out = []
    for _ in range(rng.randint(2, 10)):
        out.append(rng.choice(WHITESPACE) if rng.random() < 0.55 else rng.choice(WORDS + ["1", "!", "\u4e2d", "x"]))
    return "".join(out)


def gen_specials(rng):
    out = []
    for _ in range(rng.randint(2, 7)):
        r = rng.random()
        if r < 0.35:
            out.append(rng.choice(SPECIALS))
        elif r < 0.45:
            out.append(rng.choice(NEAR_SPECIALS))
        elif r < 0.85:
            out.append(" ".join(words(rng, rng.randint(1, 5))))
        else:
            out.append(rng.choice(["\n", " ", "  ", "\n\n", "\t", "{\"name\": \"f\", \"arguments\": {}}"]))
    return rng.choice(["", "", " ", "\n"]).join(out)


def gen_chat(rng):
    user = gen_prose(rng)
    s = f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
    s += "<|im_start|>assistant\n<think>\n" + gen_prose(rng) + "\n</think>\n\n"
    if rng.random() < 0.4:
        s += '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    else:
        s += gen_prose(rng)
    return s + "<|im_end|>"


def gen_long(rng, i):
    kinds = [
        lambda: "a" * rng.randint(500, 3000),
        lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(300, 2000))),
        lambda: "https://example.com/" + "/".join(rng.choice(WORDS) for _ in range(80)) + "?q=" + "x" * 200,
        lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
                        for _ in range(rng.randint(500, 2000))) + "==",
        lambda: "\u4e2d\u6587" * rng.randint(200, 800),
        lambda: "\U0001f600" * rng.randint(100, 400),
        lambda: " " * rng.randint(200, 2000) + "x",
        lambda: "-" * rng.randint(200, 1000) + "\n" + "=" * 300,
        lambda: "Pneumonoultramicroscopicsilicovolcanoconiosis" * rng.randint(5, 40),
        lambda: "".join(rng.choice("\u0915\u093e\u093f\u0940\u094d") for _ in range(rng.randint(200, 900))),
    ]
    return kinds[i % len(kinds)]()


def gen_random_mix(rng):
    out = []
    for _ in range(rng.randint(3, 40)):
        lo, hi = rng.choice(SAFE_RANGES)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


INVALID_UTF8 = [
    b"\x80", b"abc\x80def", b"\xc3", b"caf\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xf0\x9f\x98",
    b"\xf0\x9f\x98 x", b"\xc0\x80", b"\xc1\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80",
    b"\xf5\x80", b"\xff\xfe", b"hello \xff world", b"\xe0\x80\x80", b"\xf0\x80\x80\x80", b"\xf8\x88\x80\x80\x80",
    b"<think>\x80</think>", b"<|im_start|>\xc3<|im_end|>", b"\x80\x80\x80\x80", b"a\xe4\xb8\xad\xe6\x96",
    b"e\xcc", b"e\xcc\x81\xcc", b"  \xa0  ", b"1\xbf2\xbe3", b"\xef\xbb\xbfBOM", b"\xc2\xa0\xc2",
    b"\xe1\x80\xe1\x80\x80", b"\xf1\x80\x80\xf1\x80\x80\x80", b"x\xfe\xfe\xfe", b"\xdf\xdf\xdf",
    b"\xf0\x9f\x91\x8d\xf0\x9f", b"tab\t\xc3\t", b"crlf\r\n\xe2\r\n",
]


def build_corpus():
    rng = random.Random(20240601)
    plan = [("prose", gen_prose, 380), ("code", gen_code, 260), ("cjk", gen_cjk, 170),
            ("scripts", gen_scripts, 230), ("emoji", gen_emoji, 150), ("combining", gen_combining, 220),
            ("numbers", gen_numbers, 150), ("whitespace", gen_whitespace, 200), ("specials", gen_specials, 180),
            ("chat", gen_chat, 50), ("random", gen_random_mix, 160)]
    cases = []
    for kind, fn, n in plan:
        cases += [(kind, fn(rng)) for _ in range(n)]
    cases += [("long", gen_long(rng, i)) for i in range(40)]
    # Every fragment on its own, and every whitespace string between letters: cheap, exhaustive edges.
    for frag in CODE + CJK + SCRIPTS + EMOJI + NFC_WORDS + SPECIALS + NEAR_SPECIALS + CONTRACTIONS:
        cases.append(("fragment", frag))
    for ws in WHITESPACE:
        cases += [("ws_edge", "a" + ws + "b"), ("ws_edge", ws), ("ws_edge", "x" + ws), ("ws_edge", ws + "!")]
    cases += [("edge", s) for s in ["", " ", "\n", "a", "\x00", "a\x00b\x01\x1b[0m", "\ufeffBOM", "\ufffd",
                                     "\U0010fffd", "\ue000", "'s", "'S", "'", "''s"]]
    return cases


def bytes_to_unicode():
    """GPT-2's byte -> char map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def synthetic_tokenizer():
    """A tiny byte-level tokenizer.json exercising added-token flags (lstrip, rstrip, single_word,
    normalized), the longest-match rule and merges; ids from `tokenizers` go to synthetic.json."""
    byte_char = bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    merges = ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "\u0120w or", "\u0120wor d", "\u00c3 \u00a9"]
    for m in merges:
        a, b = m.split(" ")
        vocab[a + b] = len(vocab)
    qwen3_regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")

    def added(i, content, **flags):
        t = {"id": len(vocab) + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": False}
        t.update(flags)
        return t
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(0, "<A>", lstrip=True, special=True), added(1, "<B>", rstrip=True, special=True),
                         added(2, "<AB>"), added(3, "word", single_word=True),
                         added(4, "\u00e9t\u00e9", normalized=True)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": qwen3_regex}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges}}
    tok = Tokenizer.from_str(json.dumps(doc))
    texts = ["hello", "x<AB>y", "a  <A>b", "<B>  c", "a word b", "swordfish", "word", "word,word", "e\u0301te\u0301!",
             "\u00e9t\u00e9", " world", "<A><B><AB>", "hello<A>", "\u00e9", "ab\u3000<A>", "<B>\u3000\u00a0x",
             "  <A>  <A>", "<A", "<<AB>>"]
    cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]
    for t in doc["added_tokens"]:
        assert tok.token_to_id(t["content"]) == t["id"]
    return {"tokenizer": doc, "cases": cases}


def main():
    tok3 = Tokenizer.from_file(TOKENIZER_JSON)
    with open(TOKENIZER_JSON, encoding="utf-8") as f:
        doc = json.load(f)
    split = doc["pre_tokenizer"]["pretokenizers"][0]
    assert split["type"] == "Split" and "\\p{M}" not in split["pattern"]["Regex"]
    split["pattern"]["Regex"] = QWEN36_REGEX
    tok36 = Tokenizer.from_str(json.dumps(doc))

    cases = build_corpus()
    records = []
    for kind, text in cases:
        records.append({"kind": kind, "text": text})
    for raw in INVALID_UTF8:
        records.append({"kind": "invalid_utf8", "bytes_hex": raw.hex(), "text": raw.decode("utf-8", "replace")})
    for r in records:
        r["ids"] = tok3.encode(r["text"], add_special_tokens=False).ids
        r["ids_qwen36"] = tok36.encode(r["text"], add_special_tokens=False).ids
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
    with open(SYNTHETIC_OUT, "w", encoding="utf-8", newline="\n") as f:
        json.dump(synthetic_tokenizer(), f, ensure_ascii=False, indent=None)
        f.write("\n")
    n_diff = sum(r["ids"] != r["ids_qwen36"] for r in records)
    print(f"wrote {len(records)} cases to {OUT} ({os.path.getsize(OUT)} bytes); "
          f"{n_diff} differ between the Qwen3 and Qwen3.6 regex", file=sys.stderr)
    benchmark(tok3, [r["text"] for r in records])


def benchmark(tok, texts):
    """One-thread encode throughput over the corpus (same texts as lily's TokenizerBench), per wall
    second and per CPU second (the machine may be shared)."""
    def measure(label, inputs, reps):
        n_bytes = sum(len(t.encode("utf-8")) for t in inputs)
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(reps):
            for t in inputs:
                tok.encode(t, add_special_tokens=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"HF tokenizers encode, 1 thread, {label}: {n_bytes * reps / wall / 1e6:.2f} MB/s wall, "
              f"{n_bytes * reps / cpu / 1e6:.2f} MB/s CPU ({n_bytes} bytes x {reps})", file=sys.stderr)
    measure("per line, first pass (cold cache)", texts, 1)
    measure("per line, warm, 5 passes", texts, 5)
    measure("corpus as one string, 5 passes", ["\n".join(texts)], 5)


if __name__ == "__main__":
    main()
