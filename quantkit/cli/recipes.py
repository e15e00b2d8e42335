"""`quantkit recipes`: list the shipped recipes or show one."""

from __future__ import annotations

import click


@click.group("recipes", invoke_without_command=True)
@click.pass_context
def command(ctx):
    """List recipes (`quantkit recipes show NAME` prints one).

    \b
    Examples:
      quantkit recipes
      quantkit recipes show rtn-w4a16
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_recipes)


@command.command("list")
def list_recipes():
    """List the shipped recipes."""
    from quantkit.flow.recipe import available_recipes, load_recipe

    for name in available_recipes():
        recipe = load_recipe(name)
        click.echo(f"{name:<20} {recipe.description}")


@command.command("show")
@click.argument("name")
def show(name):
    """Print a recipe (name or file) as validated YAML, schemes resolved."""
    from quantkit.flow.recipe import load_recipe

    click.echo(load_recipe(name).to_yaml(), nl=False)
