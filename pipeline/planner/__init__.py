"""Pure planning logic: cost model, online batch forming, DGAP step planning."""
