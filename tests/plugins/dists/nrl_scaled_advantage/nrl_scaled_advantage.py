"""A third-party advantage estimator, written from docs/plugins.md alone: GRPO's group-relative
advantages multiplied by ``grpo.adv_estimator.advantage_scale``. The core's tests install it as
its own distribution and check that it changes training as its formula says."""

from nrl_core import hookimpl
from nrl_core.algorithms.advantages import group_advantages
from nrl_core.contracts import AdvantageEstimatorSpec, AdvantageInputs
from nrl_core.schema import Field, Section

NRL_CONTRACT = 3  # the plugin contract this module is written for (docs/plugins.md#8-contract-versions)


class ScaledGroupAdvantage:
    def __init__(self, section, config):
        self.scale = float(section["advantage_scale"])
        self.leave_one_out = bool(config["grpo"]["use_leave_one_out_baseline"])
        self.normalize = bool(config["grpo"]["normalize_rewards"])

    def __call__(self, inputs: AdvantageInputs):
        return self.scale * group_advantages(inputs.rewards, group_ids=inputs.group_ids,
                                             leave_one_out=self.leave_one_out, normalize=self.normalize)


@hookimpl
def nrl_advantage_estimators():
    return [AdvantageEstimatorSpec(
        name="scaled_grpo", estimator="nrl_scaled_advantage:ScaledGroupAdvantage", distribution="nrl-scaled-advantage",
        config_schema=Section(fields={"advantage_scale": Field(type=float, default=1.0,
                                                               doc="multiplies GRPO's advantages")}),
        description="GRPO's advantages times advantage_scale")]
