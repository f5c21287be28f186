"""`ketch router`: an OpenAI-compatible front that spreads requests over engine instances."""
