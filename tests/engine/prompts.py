"""Twenty varied prompts for engine tests: chat-templated and raw, short and long, code,
numbers, unicode, and pairs that share long prefixes (so prefix caching has work to do)."""

SHARED_PREFIX = (
    "You are a meticulous assistant. Read the following notes carefully before answering. "
    "The warehouse in Lyon stores 412 crates of olive oil, 96 crates of vinegar and 1,250 jars of honey. "
    "Deliveries arrive on Tuesdays and Fridays; the loading dock closes at 18:00 sharp. "
)

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: 'The cat sleeps on the red sofa.' ->",
    "Les plus beaux jardins d'Europe se trouvent",
    "日本の首都は",
    "SELECT name, COUNT(*) FROM orders WHERE",
    '{"name": "Alice", "age": 30, "city":',
    "The three laws of thermodynamics are",
    SHARED_PREFIX + "Question: how many crates of olive oil are stored?",
    SHARED_PREFIX + "Question: on which days do deliveries arrive?",
    SHARED_PREFIX + "Question: when does the loading dock close?",
    "Emoji test 🚀🔥 — what do these symbols usually mean?",
    "    indented    text\twith\ttabs\n\n\nand blank lines",
]

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 12 times 11?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Color of the sky?"}],
    [{"role": "user", "content": "List three prime numbers."}, {"role": "assistant", "content": "2, 3, 5"},
     {"role": "user", "content": "Three more?"}],
    [{"role": "user", "content": "Explain recursion to a child."}],
]


def all_prompts(tokenizer) -> list[str]:
    chats = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in CHAT_PROMPTS]
    return RAW_PROMPTS + chats
