"""English words for RULER's synthetic tasks, committed so that samples are the same on every
machine without a download. RULER draws them from the ``wonderwords`` package (its noun,
adjective and verb lists): needle keys are ``adjective-noun`` pairs (``niah``), common-words
extraction samples single words (``cwe``). These lists are smaller (about 280 adjectives,
320 nouns, 180 verbs, all common words), so ``adjective-noun`` pairs also extend the
single words where a long list needs more (RULER switches to a larger word list there).
Words of the tasks' own templates (``answer``, ``common``, ``green``, ...) and words inside
them (``able`` in ``variable``) are left out: an answer that repeats the prompt must not score."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

ADJECTIVES = tuple("""
absent abundant acidic active actual adorable afraid agile alert alive amber ancient angry
annual anxious arctic average awake bald bare basic bitter blank bleak blind blond blunt bold
bored brave brief bright brisk broad broken bumpy busy calm careful casual cheap cheerful chilly
civic clean clever cloudy clumsy coarse cold cool cosmic cozy crisp cruel curly curved
damp dark dear decent deep dense dirty distant dizzy dry dull dusty eager early earnest easy
elder empty endless equal even exact exotic faint fair false famous fancy fast fierce final
firm flat fluffy fond formal fragile free fresh friendly frozen full funny fuzzy gentle giant
glad global golden good graceful grand grateful great greedy grim gritty happy hard harsh
hasty healthy heavy high hollow honest huge humble hungry icy idle immense innocent
jolly juicy keen kind large late lazy lean light little lively lone long loose loud lovely
loyal lucky lunar mad major massive meek mellow merry mild minor misty modern modest moist
narrow nasty neat nervous new nice noble noisy normal odd old open orange oval pale patient
plain pleasant plump polite poor precious pretty proud pure purple quick quiet rapid rare raw
ready real rich rigid ripe robust rough round royal rude rural rusty sacred sad safe salty
scarce secret serene shallow sharp shiny short shy silent silky silver simple sleepy slim slow
small smart smooth soft solar solid sour spare speedy spicy stable steady steep sticky stiff
stormy strange strict strong sturdy subtle sudden sunny super sweet swift tall tame tender
thick thirsty tidy tiny tough tropical true typical ugly urban vague valid vast violet
vivid warm weak wealthy weary wet white wide wild windy wise witty wooden young zealous
""".split())

NOUNS = tuple("""
acorn actor airport album alley anchor angle ankle apple apron arch arena army arrow artist
atlas attic autumn avenue bakery balcony ballet bamboo banana band banner barn barrel basket
battery beach beacon bean beard bell belt bench berry bicycle blanket blossom boat bonnet book
bottle boulder bowl bracelet branch bread bridge brook broom bucket buffalo bugle butter button
cabin cactus camel camera canal candle canoe canyon captain carpet carrot castle cathedral
cello chair chalk channel chapel cheese cherry chess chimney circus citizen clock cloud coast
cobra coffee collar comet compass cookie copper coral cottage cotton cousin crater crayon
cricket crown crystal cupboard curtain cushion daisy dancer desert diamond doctor dolphin
donkey dragon drawer dream drum eagle easel elbow elephant elm engine envelope falcon farmer
feather fence ferry fiddle field finger forest fork fossil fountain fox garden garlic gate
ginger giraffe glacier glove goat guitar hammer harbor harp hazel helmet hill honey horizon
horse hotel island ivory jacket jaguar jar jelly jewel jungle kettle kitten ladder lagoon lake
lantern laptop lemon leopard letter library lily lion lizard lobster locket magnet mango maple
marble market meadow melody mirror monkey moon mosaic mountain mouse muffin museum nest
novel oak ocean octopus office olive onion orchard orchestra otter owl oyster paddle palace
panda paper parrot pasture peach peanut pearl pebble pencil penguin pepper piano pickle pigeon
pillow pine pirate planet plum pocket poem pond poppy potato puppet pumpkin puzzle quarry quilt
rabbit radish rainbow raven ribbon river robin rocket saddle sailor salmon sandal satchel
scarf school scissors seal shadow shell shelf ship shovel singer skate sketch sled slipper snail
sofa spider sponge spoon spruce squirrel stable stadium statue stove stream street sugar
sunset swan sweater table tailor teacher temple tent theater thimble thread thunder tiger
timber toast tomato tower tractor trail train treasure tulip tunnel turtle umbrella valley
vase velvet village violin volcano wagon walnut wand warden whale wheat whistle willow window
winter wizard wolf yacht yogurt zebra
""".split())

VERBS = tuple("""
accept admire advise agree allow amuse arrange arrive ask attach bake balance
bathe beg behave believe blink boil borrow bounce breathe brush build bury calculate call carry
carve catch change charge chase cheer chew clap climb collect comb compare complain cook copy
count cover crawl cross cry dance decide deliver describe dig discover divide drag draw dream
drift drink drive earn enjoy enter escape examine explain fetch fill fix float fold
forgive gather glow grab greet grow guard guess hang help hide hike hope hug hum hunt imagine
invent invite jog join juggle jump kick kneel knit knock laugh lead learn lift listen live
march marry measure melt mend move nod notice obey offer open order paint pass pause pick plant
play polish pour pray print promise pull push race rain reach relax remember repair rescue
rest return ride ring roll rush sail save scream search sew share shout sing skip sleep smile
sneeze sort spell spin splash stir stretch study swim talk taste teach think throw travel trust
tumble visit wait walk wander wash watch wave weave whisper wink wish wonder work write yawn
""".split())


def needle_keys() -> list[str]:
 """Every ``adjective-noun`` pair, sorted (RULER's needle keys of type ``words``)."""
 return sorted({f"{adjective}-{noun}" for adjective in ADJECTIVES for noun in NOUNS})


def single_words() -> list[str]:
 """The nouns, adjectives and verbs as one sorted list (RULER's common-words pool)."""
 return sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS))


@dataclass(frozen=True)
class Words:
    """What a synthetic task draws its words from: ``single`` words (common-words extraction's
    pool) and ``keys`` (the needles' ``words`` keys). The evaluation's are :data:`EVALUATION`;
    the experiment's pretraining corpus draws its retrieval documents from other lists
    (``sparse_ft.experiment.retrieval_docs``), so no evaluated key was ever trained on."""

    single: tuple[str, ...]
    keys: tuple[str, ...]

    @cached_property
    def pool(self) -> tuple[str, ...]:
        """The single words, then the keys: what a list longer than the single words draws."""
        return self.single + self.keys


EVALUATION = Words(single=tuple(single_words()), keys=tuple(needle_keys()))
