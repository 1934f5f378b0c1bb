"""The forward-process update (DiffusionNFT's, the family's costliest: an old-copy and a reference pass per row)
against the bare transformer work of the same (x₀, σ, ε) draws, for ``bench/speed.py`` (e) and
``bench/gpu_check.py`` (h). Never a test.

"Bare" is what any implementation of the release must run: for each of the update's draws the old copy's and the
reference's forwards without gradient (here with the weights already in place: no swap) and the trained forward
with its backward (a plain squared loss), then one optimizer step. The update's own cost over it is the draws
(seeded generators per sample), the old copy's swaps, the loss terms and their statistics, and the old copy's
move after the epoch.
"""

from __future__ import annotations

import torch

from flowgrpo.training.update import run_update


def update_and_bare(trainer, samples, adv):
    """Two callables, (the objective's update of one epoch, the bare work of its draws), and the rows each trains.

    Args:
        trainer: a :class:`~flowgrpo.training.loop.Trainer` whose objective is a forward-process one.
        samples: the rollout (:class:`~flowgrpo.records.FinalSamples`); adv: its advantages.
    """
    obj, a, optim = trainer.objective, trainer.adapter, trainer.optim
    work = obj.plan(samples, adv, adv.train_mask, 0)
    draws = [(mb, obj.draws(work, mb, 0)) for share in work.steps for mb in share]
    passes = 1 + (obj.o.kl_beta > 0)  # NFT's no-gradient forwards: the old copy, and the reference with a KL
    g = obj.o.train_guidance_scale

    def update():
        run_update(obj, a, optim, work, inner_epochs=trainer.cfg.train.inner_epochs, progress=False)

    def bare():
        with a.attention():
            for mb, ds in draws:
                x0 = samples.x0[mb.to(samples.x0.device)].to(a.device).float()
                embeds = samples.embeds.index(mb.to(samples.embeds.device))
                for d in ds:
                    s, eps = d.sigma.to(a.device), d.noise.to(a.device)
                    sv = s.reshape(-1, *[1] * (x0.ndim - 1))
                    x_t = (1 - sv) * x0 + sv * eps
                    with torch.no_grad():
                        a.velocity(x_t, s, embeds, g)
                        if passes > 1:
                            with a.reference():
                                a.velocity(x_t, s, embeds, g)
                    a.velocity(x_t, s, embeds, g).float().square().mean().backward()
        optim.optimizer.step()
        optim.zero_grad()

    return update, bare, sum(len(mb) * len(ds) for mb, ds in draws)
