"""Fixed English passages and the perplexity of an engine over them, teacher forced: what the FP8
accuracy checks (tests/fp8_accuracy_check.py, tests/fp8_kv_accuracy.py) score engines on."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from parity_tools import kiln_teacher_forced, open_executor

# Fixed English passages (written for these checks), about 170 tokens each. The first alone left the change
# in perplexity to chance: over its 195 tokens SmolLM2-135M's e4m3 cache came out +0.25% on one CPU and
# +1.39% on another (the same code; bf16 matmuls round differently from machine to machine). Over the first
# four (692 tokens) the standard error of the change was still 0.6%; all twelve bring it near 0.35%.
TEXTS = (
    "The river that runs through the old town was once the only road to the sea. Barges carried wool, "
    "salt and timber down to the harbour, and came back with spices, glass and news from distant ports. "
    "When the railway arrived, the barges grew fewer every year, and the warehouses along the water were "
    "turned into workshops, then into houses. Today children learn to swim where the boatmen used to load "
    "their cargo, and in summer the quay is crowded with people eating ice cream and watching the light "
    "change on the water. The town museum keeps a model of the last barge, built by a retired carpenter who "
    "had worked on it as a boy. He liked to say that a river remembers everything: every flood, every "
    "drought, every bridge that was built and washed away. Visitors who stop to read the notes beside the "
    "model often leave with the feeling that the town itself is a kind of boat, carried slowly forward by "
    "the current of its own history.",
    "A good loaf of bread needs only flour, water, salt and time, yet bakers argue about it for a lifetime. "
    "The flour decides how much water the dough can hold; a strong flour drinks more and gives a taller loaf. "
    "Salt slows the yeast and tightens the gluten, so it is added with care. Time is the ingredient most "
    "people rush. A dough left overnight in a cool kitchen develops a deeper flavour than one pushed through "
    "in an afternoon, because the yeast and the bacteria have longer to work on the starch. Shaping matters "
    "too: a loaf folded tightly holds its form in the oven, while a loose one spreads into a flat disc. The "
    "oven must be hot, and a little steam in the first minutes keeps the crust soft long enough for the bread "
    "to rise. When it comes out, the hardest step begins: waiting for it to cool before cutting the first slice.",
    "Most of the stars we see at night are far larger than the sun, and many of them are already gone. Their "
    "light left them long before anyone looked up, and it has been crossing empty space ever since. "
    "Astronomers measure the distance to nearby stars by watching how they seem to shift against the "
    "background as the earth moves around the sun. For stars further away they rely on the steady brightness "
    "of certain kinds of stars, whose true light output is known, and compare it with how faint they appear. "
    "Each step builds on the one before, so a small error near home can grow large at the edge of the map. "
    "That is why new telescopes spend years checking old measurements. A number that everyone trusted can "
    "change by a few percent, and with it the age and size of everything beyond our own galaxy.",
    "On the first day at a new job, most people remember the small things better than the large ones: where "
    "the coffee was kept, who showed them how the printer worked, which door stuck in wet weather. The "
    "training sessions and the rules fade within weeks, but the kindness of a colleague who explained the "
    "unwritten habits of the office stays for years. Managers who understand this spend less time on "
    "presentations and more on pairing newcomers with patient people. They also leave room for questions that "
    "sound foolish, because those are often the ones nobody else dared to ask. A team that welcomes new "
    "members well tends to keep them, and the cost of that welcome is small compared with the cost of "
    "hiring again. The best teams treat every arrival as a chance to explain, and so to check, how they work.",
    "The village library opens at nine, but the same three readers wait outside by half past eight. One comes "
    "for the newspapers, which he reads from the first page to the last, including the tide tables, although he "
    "has not owned a boat for twenty years. Another borrows detective novels, two at a time, and returns them "
    "the next morning with notes in pencil about who did it and when she guessed. The third is a student who "
    "needs the quiet more than the books. The librarian knows all of them by name, and keeps a chair by the "
    "window free for the old sailor. When the council talked about closing the branch to save money, it was "
    "these three who collected the signatures, stood at the market with a folding table, and spoke at the "
    "meeting. The branch stayed open, and the chair by the window is still kept free.",
    "A bicycle is one of the most efficient machines people have ever built. A rider on a flat road uses less "
    "energy per mile than a walker, and far less than any car. The secret lies in a few simple ideas: wheels "
    "that roll with little friction, a chain that loses almost nothing between the pedals and the rear wheel, "
    "and gears that let the legs turn at the speed where muscles work best. Early bicycles had none of these. "
    "The first ones were pushed along by the feet, and the later high wheelers were fast but dangerous, since "
    "a small stone could throw the rider over the handlebars. The safety bicycle, with two wheels of the same "
    "size and a chain drive, changed everything within a decade. It gave millions of workers a way to reach "
    "jobs further from home, and it gave many women a new kind of freedom.",
    "Learning a second language as an adult is slow at first and then suddenly faster. For weeks every "
    "sentence has to be built word by word, like a wall of loose stones, and a conversation at normal speed "
    "sounds like a single long word. Then, without any clear moment of change, common phrases start to arrive "
    "whole. The learner stops translating and begins to guess, and most of the guesses are right. Teachers "
    "say the best thing a beginner can do is to listen to a great deal of speech that is only a little too "
    "hard, and to speak early, even badly. Mistakes are how the mind finds the edges of the rules. People who "
    "wait until they feel ready often wait for years, while those who accept sounding foolish for a few "
    "months are usually chatting with strangers by the end of the first winter.",
    "Rain gardens are shallow beds planted with grasses and shrubs that can stand both wet and dry weather. "
    "They sit low in a yard or beside a street, so that water from roofs and pavements runs into them instead "
    "of into the drains. During a storm the bed fills like a bowl, and over the next day the water sinks into "
    "the soil, where the roots and the bacteria around them remove much of the oil and fertiliser it carried. "
    "A single garden does little, but a neighbourhood full of them can keep a small stream from flooding after "
    "every heavy shower. They also attract birds and insects, and they need less care than a lawn once the "
    "plants are established. The hardest part is often convincing neighbours that a patch of tall grass is "
    "not a sign of neglect but a piece of careful engineering.",
    "The old clock in the station tower lost two minutes every week for as long as anyone could remember. "
    "Travellers learned to trust their watches instead, and the porters joked that the clock kept its own "
    "time, like the stationmaster. When a young engineer was finally sent to repair it, she spent three days "
    "inside the tower before touching anything. She measured the temperature every hour, watched how the "
    "pendulum swung on windy afternoons, and found that a draught from a broken pane cooled the rod at night "
    "and made it run fast, while the sun heating the wall in the afternoon made it slow, but not quite enough. "
    "She replaced the glass and added a small weight to the pendulum. The clock has kept good time ever since, "
    "and the porters had to find something else to joke about.",
    "Most kitchens hold a small laboratory that nobody calls by that name. Heat turns sugar brown through a "
    "chain of reactions that chemists still study, and the same chemistry gives toast and roasted coffee "
    "their smell. Salt draws water out of vegetables and into meat, depending on how long it is left. An egg "
    "white beaten in a clean bowl traps air because its proteins unfold and link up around the bubbles, but a "
    "trace of fat from the yolk gets in their way and the foam collapses. Acid from a lemon can cook fish "
    "without any heat at all. A cook who knows why a recipe works can rescue it when something goes wrong, "
    "adjust it for a different oven, or invent a new dish from whatever is left in the cupboard on a Sunday "
    "evening.",
    "Mountain rescue teams in many countries are made up of volunteers who keep their boots and radios by the "
    "door. When a call comes in, often late in the day and in bad weather, they leave their jobs and their "
    "dinners and drive to the meeting point. Most rescues are not dramatic. A walker has twisted an ankle on a "
    "steep path, or a family has lost the trail in cloud and is waiting, cold and frightened, beside a cairn. "
    "The team finds them by their phone signal or their whistle, wraps them in warm layers, and walks or "
    "carries them down. The volunteers train every month on ropes, stretchers and first aid, and they raise "
    "most of their own money. Asked why they do it, many give the same short answer: one day it might be them.",
    "Before there were maps, sailors crossed open water by reading the sky and the sea. They learned which "
    "stars rose and set at certain points on the horizon, and kept a course by steering towards one star after "
    "another through the night. By day they watched the swell, which keeps its direction long after the wind "
    "that raised it has died, and felt how the hull rolled as the waves met it. Clouds that stayed still over "
    "the horizon often marked an island, and the flight of certain birds at dusk pointed towards land. This "
    "knowledge was passed from teachers to students in songs and long hours on the water. Some of it was nearly "
    "lost, but in recent decades a few navigators have sailed thousands of miles using nothing else, and "
    "taught a new generation to do the same.",
)


def text_tokens(engine_dir, add_special_tokens: bool = False) -> list[list[int]]:
    """Each passage of TEXTS as the engine's tokenizer splits it (after its BOS token, with `add_special_tokens`,
    where the tokenizer has one)."""
    tokenizer = Tokenizer.from_file(str(Path(engine_dir) / "tokenizer.json"))
    return [tokenizer.encode(text, add_special_tokens=add_special_tokens).ids for text in TEXTS]


def token_nlls(engine_dir, device: str, texts: list[list[int]]) -> torch.Tensor:
    """The negative log-likelihood of every token of every passage after its first, given those before it."""
    executor = open_executor(engine_dir, device)
    try:
        return torch.cat([torch.nn.functional.cross_entropy(
            kiln_teacher_forced(executor, tokens[:1], tokens[1:]).float(), torch.tensor(tokens[1:]), reduction="none")
            for tokens in texts])
    finally:
        executor.close()
