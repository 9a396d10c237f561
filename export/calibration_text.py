"""The text the activation-aware scales (export/awq.py) calibrate on: what a model's projections read on it sets
which input channels are rounded more finely.

Four short passages in the registers a chat model meets (a piece of history, code with its explanation, a
conversation, numbers and a recipe), written for this project, so no licence attaches to them and no dataset is
downloaded. They are not the texts the quantized exports are judged on (export/fidelity.py's paragraph and the
benchmark's second text), so the figures README reports are not measured on the calibration itself. 602 tokens
with SmolLM2's tokenizer, joined into one text; one forward pass reads them all.

The model writing its own text (seeded sampling, the first version) needs the whole model in memory and 11 s of
generation on SmolLM2, and calibrated no better: over four seeds its int4 exports' top-1 agreement on the two
benchmark texts, pooled, spread from 78.7 % to 81.3 % with mean KL divergence 0.148-0.157 / 0.133-0.137 (one-off
exports while choosing); these passages gave 78.8 % and 0.154 / 0.133 fed as four sequences, and 82.2 % and
0.140 / 0.135 joined as here (bench/results/quant_texts.json).
"""

from __future__ import annotations

CALIBRATION_SOURCE = "export/calibration_text.py"  # what export_report.json names as the calibration
CALIBRATION_TEXT = "\n\n".join(
    (
        "The canal that runs past the old mill was dug by hand between 1794 and 1801. Its builders were farm "
        "workers paid by the yard, and the ledgers that survive record every week's progress in a clerk's careful "
        "script: forty yards in a dry week, nine in a wet one, and none at all during the harvest, when the men went "
        "back to the fields. Barges carried coal and lime up the valley and brought wool and cheese down it, until "
        "the railway arrived in 1862 and the traffic dwindled within a decade. The towpath is now a walking route, "
        "and in spring the locks are repainted by volunteers who meet at the pub by the third bridge.",
        "def moving_average(values, window):\n"
        '    """Return the mean of each run of `window` consecutive values."""\n'
        "    if window <= 0:\n"
        '        raise ValueError(f"window must be positive, got {window}")\n'
        "    total = sum(values[:window])\n"
        "    averages = [total / window]\n"
        "    for i in range(window, len(values)):\n"
        "        total += values[i] - values[i - window]\n"
        "        averages.append(total / window)\n"
        "    return averages\n\n"
        "The function keeps a running total instead of summing each window again, so it takes linear time. For the "
        "list [2, 4, 6, 8, 10] and a window of 3 it returns [4.0, 6.0, 8.0].",
        "Customer: Hi, I ordered a pair of walking boots last Tuesday and they still haven't arrived. The order "
        "number is 58213.\n"
        "Agent: I'm sorry about the wait. Let me check. It looks like the parcel left our warehouse on Thursday, but "
        "the courier marked it as delayed because of the storm in the north.\n"
        "Customer: Do you know when it will get here? I'm going hiking on Saturday.\n"
        "Agent: The new estimate is Friday before noon. If it hasn't arrived by then, call us back and we'll send a "
        "replacement by express delivery at no cost.\n"
        "Customer: That's fine, thank you for your help.",
        "Water boils at 100 degrees Celsius at sea level, but at the top of a mountain 3,000 metres high it boils at "
        "about 90 degrees, because the air pressure there is roughly 70 percent of its value at sea level. This is "
        "why cooking times printed on packets often include a note for high altitude. A simple recipe for bread "
        "needs: 500 g of flour, 350 ml of warm water, 7 g of dried yeast, 10 g of salt. Mix, knead for ten minutes, "
        "leave to rise for an hour, shape the loaf, and bake it at 220 degrees for 35 minutes.",
    )
)
