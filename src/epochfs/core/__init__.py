"""What every room shares: the domain errors and the one errno table (errors), the records that cross
boundaries and their limits (records), private files (private), statistics and text helpers.
It imports nothing of epochfs outside itself."""
