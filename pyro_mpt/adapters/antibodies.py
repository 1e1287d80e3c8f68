"""A few antibody variable-domain sequences: offline demo data for AntiBERTy.

AntiBERTy (shipped in ``antiberty==0.1.3``, loaded with
``load_masked_lm("antiberty")``) reads amino-acid letters separated by spaces.
These are the heavy (VH) and light (VL) variable domains of six well-known
therapeutic antibodies, enough for examples, tests and benchmarks that must
run without network. :func:`variants` grows them into a larger set of
realistic chains (point mutations of the real ones, reproducibly), and
:func:`shuffled` gives a same-composition control that a model of antibodies
should find unlikely.
"""

import random

__all__ = ["HEAVY", "LIGHT", "AMINO_ACIDS", "spaced", "shuffled", "variants"]

#: The 20 standard amino acids, one letter each.
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"

#: VH domains: trastuzumab, adalimumab, pembrolizumab, nivolumab, rituximab, bevacizumab.
HEAVY = [
    "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    "EVQLVESGGGLVQPGRSLRLSCAASGFTFDDYAMHWVRQAPGKGLEWVSAITWNSGHIDYADSVEGRFTISRDNAKNSLYLQMNSLRAEDTAVYYCAKVSYLSTASSLDYWGQGTLVTVSS",
    "QVQLVQSGVEVKKPGASVKVSCKASGYTFTNYYMYWVRQAPGQGLEWMGGINPSNGGTNFNEKFKNRVTLTTDSSTTTAYMELKSLQFDDTAVYYCARRDYRFDMGFDYWGQGTTVTVSS",
    "QVQLVESGGGVVQPGRSLRLDCKASGITFSNSGMHWVRQAPGKGLEWVAVIWYDGSKRYYADSVKGRFTISRDNSKNTLFLQMNSLRAEDTAVYYCATNDDYWGQGTLVTVSS",
    "QVQLQQPGAELVKPGASVKMSCKASGYTFTSYNMHWVKQTPGRGLEWIGAIYPGNGDTSYNQKFKGKATLTADKSSSTAYMQLSSLTSEDSAVYYCARSTYYGGDWYFNVWGAGTTVTVSA",
    "EVQLVESGGGLVQPGGSLRLSCAASGYTFTNYGMNWVRQAPGKGLEWVGWINTYTGEPTYAADFKRRFTFSLDTSKSTAYLQMNSLRAEDTAVYYCAKYPHYYGSSHWYFDVWGQGTLVTVSS",
]

#: VL domains of the same antibodies, in the same order.
LIGHT = [
    "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
    "DIQMTQSPSSLSASVGDRVTITCRASQGIRNYLAWYQQKPGKAPKLLIYAASTLQSGVPSRFSGSGSGTDFTLTISSLQPEDVATYYCQRYNRAPYTFGQGTKVEIK",
    "EIVLTQSPATLSLSPGERATLSCRASKGVSTSGYSYLHWYQQKPGQAPRLLIYLASYLESGVPARFSGSGSGTDFTLTISSLEPEDFAVYYCQHSRDLPLTFGGGTKVEIK",
    "EIVLTQSPATLSLSPGERATLSCRASQSVSSYLAWYQQKPGQAPRLLIYDASNRATGIPARFSGSGSGTDFTLTISSLEPEDFAVYYCQQSSNWPRTFGQGTKVEIK",
    "QIVLSQSPAILSASPGEKVTMTCRASSSVSYIHWFQQKPGSSPKPWIYATSNLASGVPVRFSGSGSGTSYSLTISRVEAEDAATYYCQQWTSNPPTFGGGTKLEIK",
    "DIQMTQSPSSLSASVGDRVTITCSASQDISNYLNWYQQKPGKAPKVLIYFTSSLHSGVPSRFSGSGSGTDFTLTISSLQPEDFATYYCQQYSTVPWTFGQGTKVEIK",
]


def spaced(seqs, max_residues=None):
    """AntiBERTy's input format: ``"EVQL..."`` -> ``"E V Q L ..."``, optionally truncated."""
    return [" ".join(s[:max_residues]) for s in seqs]


def shuffled(seqs, seed=0):
    """Each sequence with its residues randomly permuted (same composition)."""
    rng = random.Random(seed)
    out = []
    for s in seqs:
        chars = list(s)
        rng.shuffle(chars)
        out.append("".join(chars))
    return out


def variants(seqs, n, rate=0.05, seed=0):
    """``n`` chains grown from ``seqs`` by random point mutations, reproducibly.

    Variant ``k`` starts from ``seqs[k % len(seqs)]`` and replaces each residue,
    with probability ``rate``, by one of the other 19 standard amino acids
    drawn uniformly -- a crude stand-in for somatic hypermutation that keeps
    each chain's length and domain structure, so a model of antibodies still
    recognizes most of it. The same ``seed`` gives the same chains on any
    machine (Python's ``random.Random``).

    :param list seqs: parent chains (one-letter amino acids).
    :param int n: how many variants.
    :param float rate: per-residue mutation probability, in [0, 1].
    :param int seed: seed of the mutations.
    :returns: a list of ``n`` strings.

    Example::

        >>> chains = HEAVY + variants(HEAVY, 94, seed=0)   # 100 heavy chains
    """
    if not seqs:
        raise ValueError("variants(seqs, n): seqs is empty; pass at least one parent chain, e.g. HEAVY.")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"variants(rate={rate!r}): a per-residue mutation probability must be in [0, 1].")
    rng = random.Random(seed)
    out = []
    for k in range(int(n)):
        chain = list(seqs[k % len(seqs)])
        for j, residue in enumerate(chain):
            if rng.random() < rate:
                chain[j] = rng.choice([a for a in AMINO_ACIDS if a != residue])
        out.append("".join(chain))
    return out
