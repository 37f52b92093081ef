"""The decode ladder's prompts: eight categories of output, a few prompts each.

Categories differ in what the model writes (code, structured text, prose), which is what moves
speculative decoding's acceptance and so per-stream speed; every prompt asks for more than the
ladder's `max_tokens`, so a stream ends at the limit rather than at its own end.
"""

from __future__ import annotations

CATEGORIES: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python module that parses a CSV file of orders, groups them by customer, and prints "
        "each customer's total. Include type hints, docstrings and a main function.",
        "Implement a binary search tree in Python with insert, delete, search and in-order traversal, "
        "and add a few usage examples at the end.",
        "Write a JavaScript function that debounces another function, then show how to use it on a "
        "search box, with comments on every step.",
    ),
    "json": (
        "Produce a JSON array of ten fictional employees, each with id, name, department, salary, "
        "start_date and a list of skills. Output only the JSON.",
        "Write a JSON object describing a small online shop: its name, address, opening hours for each "
        "day of the week, and twelve products with prices and stock counts.",
        "Return a JSON document for a weekly meal plan: seven days, each with breakfast, lunch and "
        "dinner, and for each meal the dish name, calories and ingredients.",
    ),
    "list": (
        "List thirty practical tips for keeping a vegetable garden healthy through a dry summer, one "
        "per line, numbered.",
        "Give a numbered list of twenty-five things to check before going on a long hiking trip, with "
        "a short reason for each.",
        "Make a bulleted checklist of everything needed to move to a new apartment, grouped under "
        "headings for each week before the move.",
    ),
    "math": (
        "Solve step by step: a train leaves at 9:40 travelling at 84 km/h and a second train leaves "
        "the same station at 10:15 at 102 km/h on the same track. When and where does it catch up?",
        "Explain how to compute the derivative of x^3 * sin(x), then work through the integral of "
        "x * e^x by parts, showing every step.",
        "A rectangle has a perimeter of 58 cm and an area of 210 square cm. Find its sides, then "
        "generalise the method and prove it always works.",
    ),
    "narrative": (
        "Write a short story about a lighthouse keeper who finds a message in a bottle that seems to "
        "be addressed to her, told in the first person.",
        "Tell the story of a small village that wakes up one morning to find that every clock has "
        "stopped at a different time.",
        "Write an adventure story about two siblings who get lost in a huge old library and must find "
        "their way out before it closes.",
    ),
    "prose": (
        "Write an essay on why public libraries still matter in a world where most information is "
        "online.",
        "Describe, in flowing prose, a walk through a city market early on a winter morning: the "
        "sounds, the smells and the people.",
        "Write a reflective essay on what people gain and lose when they work from home instead of an "
        "office.",
    ),
    "summary": (
        "Summarise the main causes and consequences of the industrial revolution in Britain for a "
        "high-school student, in several paragraphs.",
        "Summarise how vaccines train the immune system, covering antigens, antibodies, memory cells "
        "and booster doses.",
        "Give a detailed summary of how a bill becomes law in a parliamentary democracy, from "
        "drafting to royal or presidential assent.",
    ),
    "translation": (
        "Translate into French, sentence by sentence: 'The weather was cold, so we stayed inside and "
        "read books by the fire. Later, our neighbours came over with soup and bread, and we talked "
        "until midnight about travel, music and our childhoods.'",
        "Translate this paragraph into Spanish and then into German: 'Every morning the baker opens "
        "his shop at six. Children stop by on their way to school, and old men read the newspaper at "
        "the small table by the window.'",
        "Translate into Italian, then explain three words whose translation was not obvious: 'The "
        "museum was quiet on Monday. Only a few visitors walked slowly between the paintings, and "
        "the guards whispered to each other.'",
    ),
}
